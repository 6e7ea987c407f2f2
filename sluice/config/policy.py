"""Several learner groups in one run: which ports, services and files belong to which policy.

Policy `policies[0]` uses the ports of the plain config (control.port, weight_sync.master_port,
learner.master_port), so a single-policy run looks exactly like before. Every other policy has
its own ports in `learner.group_ports[policy]`. `policy_view` returns the config as one
policy's roles see it: the same file, with that policy's ports in the usual places.
"""

from __future__ import annotations

from pathlib import Path

from sluice.config.run import RunConfig


def policy_index(cfg: RunConfig, policy_id: str) -> int:
    try:
        return cfg.learner.policies.index(policy_id)
    except ValueError:
        raise ValueError(f"policy {policy_id!r} is not in learner.policies={cfg.learner.policies}") from None


def services_of(cfg: RunConfig, policy_id: str) -> list[int]:
    """Global indices of the rollout services that serve `policy_id`."""
    return [i for i in range(cfg.rollout.services) if policy_id in served_policies(cfg, index=i)]


def served_policies(cfg: RunConfig, index: int) -> list[str]:
    """The policies rollout service `index` talks to: with a multi-agent task every service
    serves every policy (all agents act in each episode); else service i serves
    policies[i % len(policies)]."""
    if cfg.task.agents:
        return list(cfg.learner.policies)
    return [policy_of_service(cfg, index)[0]]


def policy_of_service(cfg: RunConfig, index: int) -> tuple[str, int]:
    """(policy id, rank of the service among that policy's services) of rollout service `index`
    when each service serves one policy."""
    n = len(cfg.learner.policies)
    return cfg.learner.policies[index % n], index // n


def policy_view(cfg: RunConfig, policy_id: str) -> RunConfig:
    """The config with `policy_id`'s ports in control.port, weight_sync.master_port and
    learner.master_port."""
    if policy_index(cfg, policy_id) == 0:
        return cfg
    ports = cfg.learner.group_ports.get(policy_id)
    if ports is None or 0 in (ports.control, ports.weight_sync, ports.dist):
        raise ValueError(
            f"learner.group_ports.{policy_id}: ports not set (the local launcher sets them; "
            "a hand-written deployment must give control, weight_sync and dist)"
        )
    view = cfg.model_copy(deep=True)
    view.control.port = ports.control
    view.weight_sync.master_port = ports.weight_sync
    view.learner.master_port = ports.dist
    if view.control.bind is not None:  # the same interface, this group's port
        view.control.bind = f"{view.control.bind.rsplit(':', 1)[0]}:{ports.control}"
    if ports.host is not None:
        view.control.host = view.weight_sync.master_addr = view.learner.master_addr = ports.host
    return view


def role_suffix(cfg: RunConfig, policy_id: str) -> str:
    """'' for the first policy, '-<policy>' for the others (role and file names)."""
    return "" if policy_index(cfg, policy_id) == 0 else f"-{policy_id}"


def learner_role(cfg: RunConfig, policy_id: str, rank: int) -> str:
    """Role name of one learner process: learner, learner-r1, learner-<policy>, learner-<policy>-r1."""
    return f"learner{role_suffix(cfg, policy_id)}" + (f"-r{rank}" if rank else "")


def checkpoint_root(cfg: RunConfig, policy_id: str) -> Path:
    """Where `policy_id`'s learner group keeps its checkpoints (`latest` links the newest)."""
    return cfg.run_dir / f"checkpoints{role_suffix(cfg, policy_id)}"
