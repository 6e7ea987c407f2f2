"""The role plan: one function turns a config into the role processes a run needs, and one
function runs any of them. Every launcher starts what `plan_roles` lists (`sluice run` as
child processes, `sluice ray` as actors, compose and Slurm as one command each), and every
role process, whatever started it, runs `run_role_spec`: a config that runs locally runs the
same everywhere (docs/architecture.md, "Role plan").
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Literal

from sluice.config.learner import GroupPorts
from sluice.config.policy import learner_role, served_policies
from sluice.config.ray import RoleResources
from sluice.config.rollout import rollout_service_id
from sluice.config.run import RunConfig

RoleKind = Literal["buffer", "learner", "rollout"]


@dataclass(frozen=True)
class RoleSpec:
    """One role process of a run."""

    kind: RoleKind
    index: int  # buffer shard k, rollout service i, or the learner rank
    policy: str  # the policy a learner rank trains or a rollout service serves ("" for shards)
    name: str  # buffer-0, learner, learner-r1, learner-<policy>, rollout-3: logs, metrics, endpoints
    resources: RoleResources  # what a scheduler reserves for it (ray.<kind>)
    env: dict[str, str] = field(default_factory=dict)  # torchrun's variables for a learner rank
    exits_with_run: bool = False  # ends by itself, with 0, when the learner is done
    max_restarts: int = 0  # times a launcher starts it again when it dies (rollouts, durable shards)
    served: tuple[str, ...] = ()  # every policy a rollout service talks to (several: multi-agent)
    count: int = 1  # rollout services in this process: index .. index+count-1 (a pack of sim services)

    def belongs_to(self, policy: str) -> bool:
        """Whether the role goes down with `policy`'s learner group when that group restarts:
        its ranks and every rollout service that serves it."""
        return self.policy == policy or policy in self.served

    @property
    def args(self) -> list[str]:
        """`python -m sluice.cli <args> CONFIG`: the per-role command that runs this spec."""
        if self.kind == "buffer":
            return ["buffer", "--shard", str(self.index)]
        if self.kind == "rollout":
            pack = ["--count", str(self.count)] if self.count > 1 else []
            return ["rollout", "--index", str(self.index), *pack]
        return ["learner", "--policy", self.policy]

    @property
    def group_rank(self) -> int:
        """A learner rank's rank in its group (0 for the other roles)."""
        return int(self.env.get("RANK", "0"))


def plan_roles(cfg: RunConfig) -> list[RoleSpec]:
    """Every role process of `cfg`, in start order: shards, learner groups, rollout services."""
    ray = cfg.ray
    restarts = cfg.buffer.max_restarts if cfg.buffer.durable else 0  # (it comes back from its log)
    roles = [
        RoleSpec("buffer", k, "", f"buffer-{k}", ray.buffer, max_restarts=restarts)
        for k in range(cfg.buffer.shards)
    ]
    for policy in cfg.learner.policies:
        roles += learner_group(cfg, policy)
    per = cfg.rollout.sim.services_per_process
    if per > 1:
        n = cfg.rollout.services
        return roles + [pack_spec(cfg, i, min(per, n - i)) for i in range(0, n, per)]
    return roles + [rollout_spec(cfg, i) for i in range(cfg.rollout.services)]


def rollout_spec(cfg: RunConfig, index: int) -> RoleSpec:
    """Rollout service `index` (also one beyond rollout.services: joining a running system is
    how it scales out, docs/architecture.md, Rollout service, Membership)."""
    served = tuple(served_policies(cfg, index))
    return RoleSpec(
        "rollout",
        index,
        served[0],
        rollout_service_id(index),
        cfg.ray.rollout,
        exits_with_run=True,
        max_restarts=cfg.rollout.max_restarts,
        served=served,
    )


def pack_spec(cfg: RunConfig, first: int, count: int) -> RoleSpec:
    """Sim services first .. first+count-1 in one process (rollout_svc/pack.py); restarted as
    a whole, each of its services as a new incarnation."""
    one = rollout_spec(cfg, first)
    name = f"rollout-{first}-{first + count - 1}" if count > 1 else one.name
    return replace(one, name=name, count=count)


def learner_group(cfg: RunConfig, policy: str) -> list[RoleSpec]:
    """The ranks of one policy's learner group, with torchrun's environment when it has more
    than one (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT of the group's rank 0)."""
    lc = cfg.learner
    if policy == lc.policies[0]:
        master_addr, port = lc.master_addr, lc.master_port
    else:
        ports = lc.group_ports.get(policy, GroupPorts())
        master_addr, port = ports.host or lc.master_addr, ports.dist
    out = []
    for rank in range(lc.ranks):
        env = {}
        if lc.ranks > 1:
            env = {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(lc.ranks),
                "LOCAL_WORLD_SIZE": str(lc.ranks),
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(port),
            }
        name = learner_role(cfg, policy, rank)
        out.append(RoleSpec("learner", rank, policy, name, cfg.ray.learner, env, exits_with_run=True))
    return out


def run_role_spec(cfg: RunConfig, spec: RoleSpec, stop: threading.Event) -> int:
    """Run one role in this process until it ends or `stop` is set; its exit code. A learner
    rank reads its place in the group from the environment (`spec.env`, set by the launcher)."""
    if spec.kind == "buffer":
        from sluice.buffer.service import run_buffer

        return run_buffer(cfg, spec.index, stop)
    if spec.kind == "learner":
        from sluice.learner.loop import run_learner

        return run_learner(cfg, stop, spec.policy)
    if cfg.rollout.kind == "env":
        from sluice.rollout_svc.env_service import run_env_rollout

        return run_env_rollout(cfg, spec.index, stop)
    if spec.count > 1:
        from sluice.rollout_svc.pack import run_pack

        return run_pack(cfg, spec.index, spec.count, stop)
    if cfg.task.agents:
        from sluice.rollout_svc.agents import run_multi_agent_rollout

        return run_multi_agent_rollout(cfg, spec.index, stop)
    from sluice.rollout_svc.service import run_rollout

    return run_rollout(cfg, spec.index, stop)


def find_spec(cfg: RunConfig, kind: RoleKind, index: int = 0, policy: str | None = None) -> RoleSpec:
    """The spec a per-role command stands for (`sluice buffer --shard K`, `sluice rollout
    --index I`, `sluice learner --policy P` with RANK from the environment)."""
    policy = policy or (cfg.learner.policies[0] if kind == "learner" else None)
    if kind == "rollout" and index >= cfg.rollout.services:
        return rollout_spec(cfg, index)
    for spec in plan_roles(cfg):
        if spec.kind != kind or spec.index != index:
            continue
        if kind == "learner" and spec.policy != policy:
            continue
        return spec
    what = {"buffer": "buffer.shards", "rollout": "rollout.services", "learner": "learner.ranks"}[kind]
    raise ValueError(f"no {kind} {index}{f' of policy {policy!r}' if policy else ''} in this config ({what})")


def learner_restartable(cfg: RunConfig, policy: str, restarts_done: int, rc: int | None) -> bool:
    """Whether a launcher may restart a dead learner group from its latest checkpoint: one
    exists (before it, a restart would go back to version 0 under rollouts holding newer
    weights), `learner.max_restarts` is not used up, and the exit is not one a restart repeats
    (a bad config, a user's code that raised)."""
    from sluice.config.policy import checkpoint_root
    from sluice.launch.role import restartable

    latest = checkpoint_root(cfg, policy) / "latest"
    return latest.exists() and restarts_done < cfg.learner.max_restarts and restartable(rc)


def what_next(cfg: RunConfig, spec: RoleSpec, restarts_done: int, rc: int | None) -> str:
    """One sentence for a role that died and will not be restarted: why not, and what to do
    (the same under every launcher)."""
    from sluice.config.policy import checkpoint_root
    from sluice.launch.role import EXIT_CONFIG, EXIT_USER_CODE

    if rc in (EXIT_CONFIG, EXIT_USER_CODE):
        return "it would fail the same way again: fix what its log names, then run the config again"
    if spec.kind == "learner":
        latest = checkpoint_root(cfg, spec.policy) / "latest"
        if not latest.exists():
            return "no checkpoint to resume from yet: learner.checkpoint_every > 0 makes a run self-healing"
        why = f"learner.max_restarts={cfg.learner.max_restarts} used up"
        return f"{why}; to go on from {latest.resolve().name}, run the config again with learner.resume=auto"
    if spec.kind == "buffer" and not cfg.buffer.durable:
        return "a shard without a log (buffer.durable: false) cannot come back with what it held"
    setting = {"buffer": "buffer.max_restarts", "rollout": "rollout.max_restarts"}[spec.kind]
    return f"{setting}={spec.max_restarts} used up; run the config again with learner.resume=auto to go on"
