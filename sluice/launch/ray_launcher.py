"""`sluice ray CONFIG`: every role of a run as its own Ray actor process, placed by Ray.

The driver joins or starts a Ray cluster, places one bundle per role process in a placement
group, gathers each actor's node address and ports into the run's config, runs each role with
the same functions the per-role CLI commands call, replaces dead roles (at new addresses when
Ray moved them off a dead node: sluice/launch/ray_addresses.py), and shuts the roles down in
order. docs/architecture.md ("Ray launcher") gives the rules and why.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from sluice.config.loader import config_from_dict, dump_config
from sluice.config.ray import RoleResources
from sluice.config.run import RunConfig
from sluice.launch.departed import leave_for_dead
from sluice.launch.local import _progress_info, resolve_run_dir, run_until_signalled
from sluice.launch.plan import RoleSpec, find_spec, learner_restartable, plan_roles, run_role_spec, what_next
from sluice.launch.progress import training_progress
from sluice.launch.ray_addresses import Served, reserved_ports, write_addresses
from sluice.launch.ray_logs import RoleEndWatch, write_role_ended
from sluice.launch.ray_node_loss import handling_rank, lost_with, process_died
from sluice.launch.role import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, EXIT_USER_CODE, quiet_libraries, restartable
from sluice.metrics import JsonlLog
from sluice.modeling.policy import materialize_policy_dir
from sluice.net import HeldPorts
from sluice.plots import write_run_plots
from sluice.plugins import UserCodeError

ROLE_ENV = {
    "PYTHONUNBUFFERED": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}
LOG_DRAIN_S = 5.0  # how long shutdown waits for the roles' last lines to reach the driver
START_ATTEMPTS = 3  # actors started at most this often when they die while starting (a node loss)
log = logging.getLogger(__name__)


def shared_log(cfg: RunConfig) -> bool:
    """Whether the shards' logs are where a shard restarted on another node finds its own: an
    explicit `buffer.log_dir` is taken to be storage every node mounts (docs/architecture.md)."""
    return cfg.buffer.log_dir is not None


class RoleActor:
    """One role process on a Ray worker. Methods run in a small thread pool
    (max_concurrency=2), so `halt` reaches a role while `run` is busy."""

    def __init__(self, spec: RoleSpec, run_dir: str) -> None:
        self.spec = spec
        self.name = spec.name
        self.stop = threading.Event()
        quiet_libraries()
        fmt = logging.Formatter(f"%(asctime)s {self.name} %(levelname)s %(name)s: %(message)s")
        log_dir = Path(run_dir) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        handlers: list[logging.Handler] = [
            logging.StreamHandler(),
            logging.FileHandler(log_dir / f"{self.name}.log"),
        ]
        for h in handlers:
            h.setFormatter(fmt)
        logging.basicConfig(level=os.environ.get("SLUICE_LOG_LEVEL", "INFO"), handlers=handlers, force=True)

    def __repr__(self) -> str:  # Ray prefixes the actor's log lines with this
        return f"sluice-{self.name}"

    def node(self) -> dict[str, Any]:
        import ray

        return {
            "ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "host": os.uname().nodename,
        }

    def run(self, config: dict[str, Any]) -> int:
        """The role's main function, as the per-role command runs it (the plan's spec, from
        the resolved config: a learner rank's rendezvous address is known only now). A failure
        is logged here (role log) and re-raised to the driver; a user's code failing returns
        EXIT_USER_CODE, as `run_role` does."""
        cfg = config_from_dict(config)
        spec = find_spec(cfg, self.spec.kind, self.spec.index, self.spec.policy or None)
        os.environ.update(spec.env)
        outcome = "failed"
        try:
            code = run_role_spec(cfg, spec, self.stop)
            outcome = f"exit {code}"
            return code
        except UserCodeError:
            logging.getLogger(self.name).exception("%s failed in user code (not restarted)", self.name)
            outcome = f"exit {EXIT_USER_CODE}"
            return EXIT_USER_CODE
        except Exception:
            logging.getLogger(self.name).exception("%s failed", self.name)
            raise
        finally:
            write_role_ended(self.name, outcome)  # the driver waits for this line (ray_logs.py)

    def halt(self) -> None:
        self.stop.set()


class PortKeeper:
    """Holds a role's ports on its node for the whole run, from an actor of its own in the role's
    bundle (no CPU): a role that dies and is replaced in its bundle binds the same ports again,
    and the kernel hands them to no one in between (docs/architecture.md, "Ray launcher")."""

    def __init__(self) -> None:
        self.ports = HeldPorts()

    def reserve(self, n: int) -> list[int]:
        return [self.ports.take() for _ in range(n)]

    def pid(self) -> int:
        return os.getpid()


@dataclass
class Placed:
    """A role process the driver supervises."""

    spec: RoleSpec
    bundle: int  # placement-group bundle it lives in (a restart reuses it)
    actor: Any = None
    ref: Any = None  # ObjectRef of its `run` call; None when not running
    restarts: int = 0
    node: dict | None = None
    exit_code: int | None = None  # what its `run` returned, once it has
    died: bool = False  # its process died (so it wrote no last line)
    keeper: Any = None  # the PortKeeper of its bundle, for roles that serve on reserved ports
    keeper_pid: int | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def node_id(self) -> str | None:
        """The Ray node id its actor reported (None before it started)."""
        return (self.node or {}).get("node_id")

    def node_ip(self) -> str:
        """The IP of the node its actor runs on (reported once the actor started)."""
        if self.node is None:
            raise RuntimeError(f"{self.name}: its actor has not reported its node")
        return self.node["ip"]


class StatusPoll:
    """The learner's live numbers for the driver's progress bar, asked at most once a second
    from the control server the config names now (a learner moved to another node is asked
    there, docs/architecture.md "Ray launcher")."""

    def __init__(self, cfg: RunConfig) -> None:
        self.endpoint = ""
        self.client: Any = None
        self.next_poll = 0.0
        self._open(cfg)

    def _open(self, cfg: RunConfig) -> None:
        from sluice.control.client import ControlClient
        from sluice.security import secure_context

        self.close()
        self.endpoint = cfg.control.endpoint
        self.client = ControlClient(self.endpoint, timeout_s=2.0, ctx=secure_context(cfg.security, "client"))

    def learner(self, cfg: RunConfig) -> dict[str, Any] | None:
        """The learner's status, or None when it is not yet time to ask or nobody answered."""
        from sluice.rpc import RpcError, RpcTimeout

        if time.monotonic() < self.next_poll:
            return None
        self.next_poll = time.monotonic() + 1.0
        if cfg.control.endpoint != self.endpoint:
            self._open(cfg)
        try:
            return self.client.status().learner
        except (RpcTimeout, RpcError):
            return None

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


class PlacementError(RuntimeError):
    """The cluster cannot hold the run's roles (found before waiting for a placement)."""


def plan_resources(specs: list[RoleSpec]) -> dict[str, float]:
    """What every role process of the plan reserves, summed by resource."""
    total: dict[str, float] = {}
    for spec in specs:
        for key, value in _bundle(spec.resources).items():
            total[key] = total.get(key, 0.0) + value
    return total


def _bundle(res: RoleResources) -> dict[str, float]:
    out = {"CPU": res.num_cpus, "GPU": res.num_gpus, **res.resources}
    return {k: v for k, v in out.items() if v > 0}


class RayLauncher:
    def __init__(self, cfg: RunConfig, console: Console | None = None, show_progress: bool = True) -> None:
        self.cfg = cfg.model_copy(deep=True)
        resolve_run_dir(self.cfg)
        self.run_dir = self.cfg.run_dir
        self.console = console or Console(stderr=True)
        self.show_progress = show_progress
        self.stop = threading.Event()
        self.placed: list[Placed] = []
        self.learner_restarts: dict[str, int] = {}  # policy -> times its group was restarted
        self.pg = None
        self.events: JsonlLog | None = None
        self.config: dict[str, Any] = {}
        self.actor_class: Any = None
        self.keeper_class: Any = None
        self.ends = RoleEndWatch()

    # -- cluster and placement -----------------------------------------------------------------

    def connect(self) -> None:
        """Join the cluster, or start a local instance sized for the plan; either way fail in
        seconds, naming the keys to change, when the roles' resources cannot all be granted
        (instead of waiting ray.ready_timeout_s for a placement that never comes)."""
        import ray

        rc = self.cfg.ray
        specs = plan_roles(self.cfg)
        need = plan_resources(specs)
        env = {**ROLE_ENV, **rc.env}
        kwargs: dict[str, Any] = {"namespace": rc.namespace, "runtime_env": {"env_vars": env}}
        if rc.address is None:
            kwargs |= {"num_cpus": self._local_cpus(need["CPU"]), "include_dashboard": False}
        # "local": a new instance even where a cluster runs on this machine or RAY_ADDRESS names
        # one (ray.init's default would join it, and refuse num_cpus for it)
        ray.init(address=rc.address or "local", log_to_driver=True, **kwargs)
        self.ends.attach()
        self.actor_class = ray.remote(RoleActor)
        self.keeper_class = ray.remote(PortKeeper)
        have = ray.cluster_resources()
        short = {k: (v, have.get(k, 0.0)) for k, v in need.items() if have.get(k, 0.0) + 1e-9 < v}
        if short:
            ray.shutdown()
            wants = ", ".join(f"{k}: {v:g} needed, {h:g} in the cluster" for k, (v, h) in short.items())
            raise PlacementError(
                f"ray: the run's {len(specs)} role processes need more "
                f"than the cluster has ({wants}); lower ray.buffer/learner/rollout.num_cpus (or num_gpus, "
                "resources), run fewer processes, or add nodes"
            )

    def _local_cpus(self, needed: float) -> int:
        """Logical CPUs of a local instance: ray.local_num_cpus, or enough for one bundle per
        role process even on a machine with fewer cores (roles share cores, as under
        `sluice run`; the thread split is the role's, docs/architecture.md "Cores and threads")."""
        cores = os.cpu_count() or 1
        cpus = self.cfg.ray.local_num_cpus or max(cores, math.ceil(needed))
        if cpus > cores:
            self.console.print(
                f"local Ray instance: {cpus} logical CPUs for the run's role processes on {cores} cores "
                "(set ray.local_num_cpus to choose)"
            )
        return cpus

    def place(self) -> None:
        import ray
        from ray.exceptions import GetTimeoutError
        from ray.util import placement_group

        rc = self.cfg.ray
        specs = plan_roles(self.cfg)
        bundles = [_bundle(spec.resources) for spec in specs]
        self.pg = pg = placement_group(bundles, strategy=rc.strategy, name=f"sluice-{self.cfg.run.name}")
        try:
            ray.get(pg.ready(), timeout=rc.ready_timeout_s)
        except GetTimeoutError:
            raise RuntimeError(
                f"Ray did not grant the placement group within {rc.ready_timeout_s:.0f}s: asked for "
                f"{bundles} ({rc.strategy}); the cluster has {ray.cluster_resources()}"
            ) from None
        self.placed = [Placed(spec, b) for b, spec in enumerate(specs)]
        for p in self.placed:  # keepers start beside the role actors (resolve_addresses uses them)
            if reserved_ports(p.spec):
                p.keeper = self._keeper(pg, p.bundle)
        self._start_actors(self.placed)

    def _start_actors(self, placed: list[Placed]) -> None:
        """One actor per role in its bundle; they start in parallel, each reports its node. An
        actor that dies while starting (its node died under it; Ray then moves the node's
        bundles) is started again, START_ATTEMPTS times in all."""
        import ray
        from ray.exceptions import RayActorError

        for attempt in range(1, START_ATTEMPTS + 1):
            self._create_actors(placed)
            try:
                nodes = ray.get([p.actor.node.remote() for p in placed], timeout=self.cfg.ray.ready_timeout_s)
                break
            except RayActorError as e:
                if attempt == START_ATTEMPTS:
                    raise
                why = str(e).strip().splitlines()[-1]
                self.console.print(f"[yellow]a role died while starting ({escape(why)}): starting them again")
                for p in placed:
                    ray.kill(p.actor, no_restart=True)
        for p, node in zip(placed, nodes):
            p.node = node

    def _create_actors(self, placed: list[Placed]) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = self.pg
        if pg is None:
            raise RuntimeError("ray launcher: no placement group to start actors in (start() makes it)")
        for p in placed:
            res = p.spec.resources
            p.actor = self.actor_class.options(
                num_cpus=res.num_cpus,
                num_gpus=res.num_gpus,
                resources=res.resources or None,
                max_concurrency=2,
                max_restarts=0,  # the driver replaces failed roles itself (see _on_exit)
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=p.bundle
                ),
            ).remote(p.spec, str(self.run_dir))
            p.died = False

    # -- addresses -----------------------------------------------------------------------------

    def resolve_addresses(self) -> RunConfig:
        """Ports reserved on the roles' own nodes (by their bundles' keepers), written into the
        config: each shard's endpoint, and for each learner group its rank 0's node with a
        control, weight-sync store and rendezvous port."""
        cfg = self.cfg.model_copy(deep=True)
        write_addresses(cfg, self._reserve([p for p in self.placed if p.keeper is not None]))
        return cfg

    def _reserve(self, placed: list[Placed]) -> list[Served]:
        """Each role's ports, reserved by its keeper on its node (and the keeper's pid noted)."""
        import ray

        ports = ray.get([p.keeper.reserve.remote(reserved_ports(p.spec)) for p in placed])
        pids = ray.get([p.keeper.pid.remote() for p in placed])
        for p, pid in zip(placed, pids):
            p.keeper_pid = pid
        return [Served(p.spec, p.node_ip(), held) for p, held in zip(placed, ports)]

    def _readdress(self, moved: list[Placed]) -> None:
        """Roles that serve on reserved ports and came back on another node (theirs died, and
        Ray moved their bundles): a new keeper in each bundle reserves ports on the new node
        (the old keeper died with the old one), and the run's config names them from now on.
        The caller restarts the roles that hold the old addresses."""
        import ray

        for p in moved:
            ray.kill(p.keeper, no_restart=True)  # (gone with its node; a no-op then)
            p.keeper = self._keeper(self.pg, p.bundle)
        cfg = self.cfg.model_copy(deep=True)
        write_addresses(cfg, self._reserve(moved))
        self.cfg, self.config = cfg, cfg.model_dump(mode="json")
        dump_config(cfg, self.run_dir / "config.yaml")
        for p in moved:
            self.console.print(
                f"[yellow]{p.name} moved to {p.node_ip()}: the run's config names it there now"
            )

    def _keeper(self, pg: Any, bundle: int) -> Any:
        """A PortKeeper actor in `pg`'s `bundle`: on its role's node, outliving any of its role's
        actors."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)
        return self.keeper_class.options(num_cpus=0, max_restarts=0, scheduling_strategy=strategy).remote()

    def _get(self, name: str) -> Placed:
        return next(p for p in self.placed if p.name == name)

    # -- run -----------------------------------------------------------------------------------

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.events = JsonlLog(self.run_dir / "metrics" / "launcher.jsonl")
        materialize_policy_dir(self.cfg)  # an LLM or an MLP policy, as `sluice run` builds it
        self.connect()
        self.place()
        self.cfg = self.resolve_addresses()
        dump_config(self.cfg, self.run_dir / "config.yaml")
        self.config = self.cfg.model_dump(mode="json")
        for p in self.placed:
            self._record("placed", p)
            p.ref = p.actor.run.remote(self.config)

    def _record(self, event: str, p: Placed, **extra: Any) -> None:
        assert self.events is not None
        held = {} if p.keeper_pid is None else {"ports_held_by": p.keeper_pid}
        self.events.write(
            {"event": event, "role": p.name, "bundle": p.bundle, **(p.node or {}), **held, **extra}
        )

    def supervise(self) -> int:
        """Wait for the learner; replace failed rollouts; fail on any other death."""
        import ray

        progress = training_progress(self.console, enabled=self.show_progress, refresh_per_second=2)
        code = EXIT_FAILED
        status = StatusPoll(self.cfg)
        try:
            with progress:
                task = progress.add_task(
                    "training (ray)", total=self.cfg.learner.total_steps, info="starting roles"
                )
                while True:
                    if self.stop.is_set():
                        self.console.print("[yellow]interrupted: stopping every role")
                        code = 130
                        break
                    running = {p.ref: p for p in self.placed if p.ref is not None}
                    ready, _ = ray.wait(list(running), num_returns=len(running), timeout=0.5)
                    verdict = None
                    for ref in self._ended_in_order(ready, running):
                        if running[ref].ref is not ref:  # restarted meanwhile (its learner group)
                            continue
                        verdict = self._on_exit(running[ref]) if verdict is None else verdict
                    if verdict is not None:
                        code = verdict
                        break
                    learner = status.learner(self.cfg)
                    if learner is not None and "reward_mean" in learner:
                        progress.update(task, completed=learner["version"], info=_progress_info(learner))
        finally:
            status.close()
        return code

    def _ended_in_order(self, ready: list[Any], running: dict[Any, Placed]) -> list[Any]:
        """The `run` calls that ended, with those of the roles a lost node took along, in the
        order to handle them (sluice/launch/ray_node_loss.py says why)."""
        died = [running[r] for r in ready if process_died(r)]
        nodes = {p.node_id for p in died if p.node_id}
        others = [(r, p) for r, p in running.items() if r not in ready and p.node_id in nodes]
        if others:
            self.console.print(
                f"[yellow]{', '.join(p.name for p in died)} died: asking "
                f"{', '.join(p.name for _, p in others)} on the same node whether they are still there"
            )

            def say(line: str) -> None:
                self.console.print(f"[yellow]{escape(line)}")

            mates = [(p.name, r, p.actor) for r, p in others]
            ready = [*ready, *lost_with(mates, lambda actor: actor.node.remote(), say)]
        return sorted(ready, key=lambda r: handling_rank(running[r].spec.kind))

    def _on_exit(self, p: Placed) -> int | None:
        """A role's `run` returned or its process died. Returns the run's exit code when this
        ends the run, None when the run goes on."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        ref, p.ref = p.ref, None
        try:
            rc, error = ray.get(ref), None
        except RayActorError as e:
            rc, error = None, f"process died: {str(e).splitlines()[0]}"
            p.died = True
        except RayTaskError as e:
            rc, error = None, f"failed: {str(e).strip().splitlines()[-1]}"
        self._record("exit", p, rc=rc, error=error)
        error = escape(error) if error is not None else None  # printed as rich markup below
        p.exit_code = rc if isinstance(rc, int) else None
        if p.spec.kind == "learner":
            if rc != EXIT_OK and self._restart_learner_group(p, rc, error):
                return None
            if rc != EXIT_OK:
                code = rc if isinstance(rc, int) else None
                hint = what_next(self.cfg, p.spec, self.learner_restarts.get(p.spec.policy, 0), code)
                self.console.print(
                    f"[red]{p.name} ended ({error or f'exit {rc}'}); see {self.run_dir}/logs/{p.name}.log. "
                    f"It is not restarted: {escape(hint)}"
                )
                return EXIT_FAILED
            done = all(q.exit_code == EXIT_OK for q in self.placed if q.spec.kind == "learner")
            return EXIT_OK if done else None  # the run ends when every learner rank has
        if p.spec.exits_with_run and rc == EXIT_OK:
            return None  # a rollout ends itself when the learner announces shutdown
        if p.restarts < p.spec.max_restarts and restartable(rc if isinstance(rc, int) else None):
            return self._restart_role(p, error or f"exited {rc}")
        hint = what_next(self.cfg, p.spec, p.restarts, rc if isinstance(rc, int) else None)
        why = error or f"exited {rc}"
        self.console.print(
            f"[red]{p.name} {why}; failing the run (logs: {self.run_dir}/logs): {escape(hint)}"
        )
        return EXIT_FAILED

    def _restart_role(self, p: Placed, why: str) -> int | None:
        """A dead rollout service or durable shard, again in its bundle (the same node, unless
        the node died: `_shard_moved`). None: running again; EXIT_FAILED: not."""
        import ray

        p.restarts += 1
        self.console.print(f"[yellow]{p.name} {why}; restarting it ({p.restarts}/{p.spec.max_restarts})")
        ray.kill(p.actor, no_restart=True)
        gone = leave_for_dead(self.cfg, p.spec, int((p.node or {}).get("pid", 0)))  # no publish waits for it
        if self._start_actors_again([p]):  # only a shard among the roles restarted here serves
            return self._shard_moved(p, why)
        self._record("restarted", p, restarts=p.restarts, reason=why, left_weight_sync=gone)
        p.ref = p.actor.run.remote(self.config)
        return None

    def _shard_moved(self, p: Placed, why: str) -> int | None:
        """A shard whose node died came back on another: with a log every node mounts it serves
        again at its new address (already in the config), and every learner group restarts
        from its checkpoint (with its rollout services) to learn it; else the run fails
        rather than serve an empty shard. None: running again; EXIT_FAILED: not."""
        if not shared_log(self.cfg):
            self.console.print(
                f"[red]{p.name} came back on another node ({p.node_ip()}), away from its log: failing "
                "the run rather than serving an empty shard. Give buffer.log_dir a directory every node "
                "mounts, then run the config again with learner.resume=auto"
            )
            return EXIT_FAILED
        self._record("restarted", p, restarts=p.restarts, reason=why)
        p.ref = p.actor.run.remote(self.config)
        heads = [q for q in self.placed if q.spec.kind == "learner" and q.spec.index == 0]
        for head in heads:
            if not self._restart_learner_group(head, None, f"{p.name} moved to {p.node_ip()}"):
                done = self.learner_restarts.get(head.spec.policy, 0)
                hint = what_next(self.cfg, head.spec, done, None)
                self.console.print(
                    f"[red]{head.name} cannot restart to learn where {p.name} moved: {escape(hint)}"
                )
                return EXIT_FAILED
        return None

    def _start_actors_again(self, placed: list[Placed]) -> list[Placed]:
        """`_start_actors` for roles that ran before; a serving role among them that Ray put
        on another node (its node died) is re-addressed (`_readdress`) before anyone runs.
        Returns those moved serving roles."""
        was = {p.name: p.node_id for p in placed}
        self._start_actors(placed)
        moved = [p for p in placed if p.keeper is not None and p.node_id != was[p.name]]
        if moved:
            self._readdress(moved)
        return moved

    def _restart_learner_group(self, p: Placed, rc: Any, error: str | None) -> bool:
        """As under `sluice run` (LocalLauncher._restart_learner_group: the group and its
        policy's rollout services, in their bundles, the learner from its latest checkpoint);
        the checkpoint must be where this driver sees the run directory (one node, or a
        shared file system)."""
        import ray

        policy = p.spec.policy
        done = self.learner_restarts.get(policy, 0)
        if not learner_restartable(self.cfg, policy, done, rc if isinstance(rc, int) else None):
            return False
        self.learner_restarts[policy] = done + 1
        group = [q for q in self.placed if q.spec.kind != "buffer" and q.spec.belongs_to(policy)]
        self.console.print(
            f"[yellow]{p.name} {error or f'exited {rc}'}; restarting its learner group (and its rollout "
            f"services) from the latest checkpoint ({done + 1}/{self.cfg.learner.max_restarts})"
        )
        for q in group:  # rollouts before the new learner counts what the shards hold
            q.ref, q.exit_code = None, None
            ray.kill(q.actor, no_restart=True)
        group.sort(key=lambda q: q.spec.kind != "learner")
        self._start_actors_again(group)
        resumed = {**self.config, "learner": {**self.config["learner"], "resume": "auto"}}
        for q in group:
            self._record("restarted", q, restarts=done + 1, reason=error or f"exit {rc}")
            q.ref = q.actor.run.remote(resumed if q.spec.kind == "learner" else self.config)
        return True

    def shutdown(self, grace_s: float = 15.0) -> None:
        import ray

        if not ray.is_initialized():  # (connect refused the plan and disconnected)
            self.ends.detach()
            if self.events is not None:
                self.events.close()
            return
        order = [p for r in ("rollout", "learner", "buffer") for p in self.placed if p.spec.kind == r]
        for p in order:
            if p.ref is not None:
                p.actor.halt.remote()
        pending = [p.ref for p in order if p.ref is not None]
        if pending:
            ray.wait(pending, num_returns=len(pending), timeout=grace_s)
        self._drain_role_logs(order)
        for p in order:
            if p.actor is not None:
                ray.kill(p.actor, no_restart=True)
            if p.keeper is not None:  # its ports are free only now
                ray.kill(p.keeper, no_restart=True)
        if self.pg is not None:
            ray.util.remove_placement_group(self.pg)
        if self.events is not None:
            self.events.close()
        # Stops the local instance if this driver started one; otherwise only disconnects.
        ray.shutdown()
        self.ends.detach()

    def _drain_role_logs(self, placed: list[Placed]) -> None:
        """Waits, at most LOG_DRAIN_S, until the last line of every role whose `run` has ended
        (and whose process lived to write it) has been forwarded to this driver."""
        pids = {p.node["pid"] for p in placed if p.node is not None and self._wrote_last_line(p)}
        missing = self.ends.wait_for(pids, LOG_DRAIN_S)
        if missing:
            log.debug(
                "ray: the last lines of pids %s did not reach the driver in %.0fs", missing, LOG_DRAIN_S
            )

    @staticmethod
    def _wrote_last_line(p: Placed) -> bool:
        import ray
        from ray.exceptions import RayActorError

        if p.ref is None:
            return p.actor is not None and not p.died
        if not ray.wait([p.ref], timeout=0)[0]:
            return False  # still running: halt did not reach it within the grace
        try:
            ray.get(p.ref, timeout=0)
        except RayActorError:
            return False
        except Exception:
            pass  # its `run` raised: the line was written on the way out
        return True

    def run(self) -> int:
        try:
            self.start()
            code = self.supervise()
        except PlacementError as e:
            self.console.print(f"[red]{escape(str(e))}")
            return EXIT_CONFIG
        finally:
            self.shutdown()
        plots = write_run_plots(self.run_dir)
        if plots:
            self.console.print(f"plots: {', '.join(p.name for p in plots)} in {plots[0].parent}")
        self.console.print(f"run directory: {self.run_dir}")
        return code


def run_ray(cfg: RunConfig, show_progress: bool = True) -> int:
    return run_until_signalled(RayLauncher(cfg, show_progress=show_progress))
