"""`sluice run CONFIG`: every role of a run as separate processes on this machine.

The launcher resolves what the config leaves open (run directory, free ports), writes
`<run dir>/config.yaml`, and starts buffer shards, the learner and the rollout services with
`python -m sluice.cli <role> <run dir>/config.yaml` (spawned, or forked from a server that
imported torch and transformers once: launch/forkserver.py). Each child runs in its own session
(a terminal Ctrl-C reaches only the launcher, which then stops the children in order) and gets
SIGTERM if the launcher dies. The run ends when the learner exits: 0 means done. A rollout
service that dies (killed, crashed) is started again with the same index, up to
`rollout.max_restarts` times, and joins the running system as a new member; so is a durable
buffer shard (`buffer.max_restarts`, from its log, on the same port); a learner group restarts
from its checkpoint; any other role that dies unexpectedly fails the run loudly with its log
tail.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Protocol

from rich.console import Console

from sluice.config.learner import GroupPorts
from sluice.config.loader import ENV_PREFIX, dump_config
from sluice.config.run import RunConfig
from sluice.launch.departed import leave_for_dead
from sluice.launch.forkserver import RoleForker, RoleProcess, forked
from sluice.launch.plan import RoleSpec, learner_restartable, plan_roles, what_next
from sluice.launch.progress import training_progress
from sluice.launch.role import EXIT_FAILED, EXIT_OK, restartable
from sluice.launch.threads import (
    available_cores,
    core_ids,
    plan_cores,
    plan_threads,
)
from sluice.metrics import JsonlLog
from sluice.net import HeldPorts

log = logging.getLogger(__name__)


@dataclass
class Child:
    spec: RoleSpec  # what it runs (sluice/launch/plan.py)
    proc: RoleProcess  # subprocess.Popen, or a fork of the role server (launch/forkserver.py)
    log_path: Path
    restarts: int = 0  # times this role was started again after dying

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def is_learner(self) -> bool:
        """A rank of a learner group: the run ends when all of them exit."""
        return self.spec.kind == "learner"


@dataclass
class Tail:
    """Incremental reader of a JSONL metrics file. A learner that resumes rewrites its file
    shorter (learner/metrics.py): a new file (another inode) or one shorter than what was read
    is read again from its start, and a line that is not JSON is skipped with a warning."""

    path: Path
    offset: int = 0
    inode: int = -1
    last: dict = field(default_factory=dict)

    def poll(self) -> list[dict]:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return []
        if stat.st_ino != self.inode or stat.st_size < self.offset:
            self.inode, self.offset = stat.st_ino, 0
        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            chunk = fh.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        records = []
        for line in complete.splitlines():
            try:
                if line.strip():
                    records.append(json.loads(line))
            except json.JSONDecodeError as e:
                log.warning("%s: skipped a line that is not JSON (%s)", self.path, e)
        if records:
            self.last = records[-1]
        return records


def resolve_run_dir(cfg: RunConfig) -> None:
    """run.dir, or runs/<name>-<time>, as an absolute path."""
    if cfg.run.dir is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        cfg.run.dir = str(Path("runs") / f"{cfg.run.name}-{stamp}")
    cfg.run.dir = str(Path(cfg.run.dir).resolve())


def resolve(cfg: RunConfig, ports: HeldPorts) -> RunConfig:
    """Fill in the run directory, free ports and thread counts; the result is what every
    child reads. Each port chosen here stays held in `ports` until the caller closes it (after
    the run), so no other process on the host is given it before its role binds it."""
    cfg = cfg.model_copy(deep=True)
    resolve_run_dir(cfg)
    b = cfg.buffer
    if not b.endpoints and b.base_port == 0:
        b.endpoints = [f"tcp://{b.host}:{ports.take(b.host)}" for _ in range(b.shards)]
    if cfg.control.port == 0:
        cfg.control.port = ports.take(cfg.control.host)
    if cfg.weight_sync.master_port == 0:
        cfg.weight_sync.master_port = ports.take(cfg.weight_sync.master_addr)
    lc = cfg.learner
    if lc.master_port == 0:
        lc.master_port = ports.take(lc.master_addr)
    for policy in lc.policies[1:]:  # each further learner group gets its own ports
        given = lc.group_ports.get(policy, GroupPorts())
        lc.group_ports[policy] = GroupPorts(
            control=given.control or ports.take(cfg.control.host),
            weight_sync=given.weight_sync or ports.take(cfg.weight_sync.master_addr),
            dist=given.dist or ports.take(lc.master_addr),
        )
    return plan_threads(cfg, available_cores())


class LocalLauncher:
    def __init__(self, cfg: RunConfig, console: Console | None = None, show_progress: bool = True) -> None:
        self.ports = HeldPorts()
        self.cfg = resolve(cfg, self.ports)
        self.run_dir = self.cfg.run_dir
        self.console = console or Console(stderr=True)
        self.show_progress = show_progress
        self.children: list[Child] = []
        self.learner_restarts: dict[str, int] = {}  # policy -> times its group was restarted
        self.stop = threading.Event()
        self.pinning = plan_cores(self.cfg, plan_roles(self.cfg), core_ids())  # role name -> env
        self.forker = RoleForker()

    def prepare(self) -> Path:
        """The run directory and its resolved config. The model directory is not built here:
        every role builds it if it is missing (atomically: one copy wins), while its imports
        would hold up every role's start here (transformers and torch: ~5 s on 2 cores)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        config_path = self.run_dir / "config.yaml"
        dump_config(self.cfg, config_path)
        return config_path

    def _spawn(self, spec: RoleSpec, config_path: Path, overrides: list[str] | None = None) -> Child:
        log_path = self.run_dir / "logs" / f"{spec.name}.log"
        # SLUICE__* overrides are already in the resolved config; applied again they could
        # undo what the launcher resolved (e.g. a port of 0).
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith(ENV_PREFIX)}
        env.update(SLUICE_DIE_WITH_PARENT="1", PYTHONUNBUFFERED="1", **spec.env)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(self.pinning.get(spec.name, {}))
        args = [*spec.args, str(config_path), *(overrides or [])]
        if forked(self.cfg, spec):
            proc: RoleProcess = self.forker.start(args, env, log_path)
        else:
            with log_path.open("ab") as log_fh:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "sluice.cli", *args],
                    stdout=log_fh,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                )
        child = Child(spec, proc, log_path)
        self.children.append(child)
        return child

    def start(self) -> None:
        config_path = self.prepare()
        for spec in plan_roles(self.cfg):
            self._spawn(spec, config_path)

    # -- supervision ---------------------------------------------------------------------------

    def supervise(self) -> int:
        """Wait for the learner; fail fast if any other role dies. Returns the run's exit code."""
        tail = Tail(self.run_dir / "metrics" / "learner.jsonl")
        run_log = JsonlLog(self.run_dir / "metrics" / "launcher.jsonl")
        total = self.cfg.learner.total_steps
        progress = training_progress(self.console, enabled=self.show_progress, refresh_per_second=4)
        code = EXIT_FAILED
        with progress:
            task = progress.add_task("training", total=total, info="starting roles")
            while True:
                if self.stop.is_set():
                    self.console.print("[yellow]interrupted: stopping every role")
                    code = 130
                    break
                for record in tail.poll():
                    run_log.write({"event": "learner_step", "version": record.get("version")})
                if tail.last:
                    progress.update(
                        task, completed=tail.last.get("version", 0), info=_progress_info(tail.last)
                    )
                decided = self._poll_children(run_log)
                if decided is not None:
                    code = decided
                    break
                time.sleep(0.25)
            tail.poll()
            if tail.last:
                progress.update(task, completed=tail.last.get("version", 0), info=_progress_info(tail.last))
        run_log.close()
        return code

    def _poll_children(self, run_log: JsonlLog) -> int | None:
        """The run's exit code once it is decided (every learner done, or a role dead that is not
        restarted), else None. Learner groups and rollout services are restarted here."""
        learners = [c for c in self.children if c.is_learner]
        failed = [c for c in learners if c.proc.poll() not in (None, 0)]
        failed = [c for c in failed if not self._restart_learner_group(c, run_log)]
        if not failed and all(c.proc.poll() == 0 for c in learners):
            return EXIT_OK
        if not failed:
            dead = [c for c in self.children if c.proc.poll() is not None and not c.is_learner]
            failed = [c for c in dead if not (c.spec.exits_with_run and c.proc.returncode == 0)]
            failed = [c for c in failed if not self._restart(c, run_log)]
        for c in failed:
            self._report_death(c, c.proc.returncode)
        return EXIT_FAILED if failed else None

    def _restart(self, child: Child, run_log: JsonlLog) -> bool:
        """Start a dead rollout service (same index, new incarnation) or durable shard (same
        endpoint, from its log) again. False: not restartable, or its restarts are used up
        (`rollout.max_restarts`, `buffer.max_restarts`)."""
        limit = child.spec.max_restarts
        rc = child.proc.returncode
        if child.restarts >= limit or not restartable(rc):
            return False
        _signal_group(child.proc, signal.SIGKILL)  # whatever it started (engine processes)
        self.children.remove(child)
        gone = leave_for_dead(self.cfg, child.spec, child.proc.pid)  # no publish waits for it
        new = self._spawn(child.spec, self.run_dir / "config.yaml")
        new.restarts = child.restarts + 1
        self.console.print(
            f"[yellow]{child.name} exited with code {rc}; restarting it ({new.restarts}/{limit})"
        )
        run_log.write(
            {
                "event": "restarted",
                "role": child.name,
                "rc": rc,
                "restarts": new.restarts,
                "pid": new.proc.pid,
                "left_weight_sync": gone,
            }
        )
        return True

    def _restart_learner_group(self, child: Child, run_log: JsonlLog) -> bool:
        """A learner rank died: stop its whole group and its policy's rollout services, then
        start the group again from its latest checkpoint (`learner.resume=auto`) and the
        services after it. The shards keep the data; what the lost steps trained is trained
        again (their leases were never ACKed). The services go too because they hold grants of
        the dead learner's control server and its weight-sync store: one that PUT a batch after
        the new learner counted the backlog would keep that many samples beyond the staleness
        bound in flight for the rest of the run. False: not restartable (learner_restartable)."""
        if child not in self.children:  # another rank of its group, dead in the same poll: restarted
            return True
        rc, policy = child.proc.returncode, child.spec.policy
        done = self.learner_restarts.get(policy, 0)
        if not learner_restartable(self.cfg, policy, done, rc):
            return False
        group = [c for c in self.children if c.spec.kind != "buffer" and c.spec.belongs_to(policy)]
        for c in group:  # rollouts before the new learner counts what the shards hold
            _signal_group(c.proc, signal.SIGKILL)
            c.proc.wait()
            self.children.remove(c)
        self.learner_restarts[policy] = done + 1
        self.console.print(
            f"[yellow]{child.name} exited with code {rc}; restarting its learner group (and its rollout "
            f"services) from the latest checkpoint ({done + 1}/{self.cfg.learner.max_restarts})"
        )
        for c in sorted(group, key=lambda c: c.spec.kind != "learner"):
            extra = ["learner.resume=auto"] if c.is_learner else []
            new = self._spawn(c.spec, self.run_dir / "config.yaml", extra)
            new.restarts = c.restarts
            run_log.write(
                {"event": "restarted", "role": c.name, "rc": rc, "restarts": done + 1, "pid": new.proc.pid}
            )
        return True

    def _child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def _report_death(self, child: Child, rc: int) -> None:
        lines = child.log_path.read_text(errors="replace").splitlines()[-25:]
        self.console.print(f"[red]{child.name} exited with code {rc}; last lines of {child.log_path}:")
        self.console.print("\n".join(lines), markup=False, highlight=False)
        done = self.learner_restarts.get(child.spec.policy, 0) if child.is_learner else child.restarts
        self.console.print(f"[red]{child.name} is not restarted: {what_next(self.cfg, child.spec, done, rc)}")

    def shutdown(self, grace_s: float = 15.0) -> None:
        """Rollouts first (they read weights from the learner), then the learner, then shards.
        SIGTERM, wait up to `grace_s`, then SIGKILL the process group."""
        order = [c for kind in ("rollout", "learner", "buffer") for c in self.children if c.spec.kind == kind]
        for c in order:
            if c.proc.poll() is None:
                _signal_group(c.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in order:
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # Anything the role started (e.g. vLLM engine processes) lives in its process group.
            _signal_group(c.proc, signal.SIGKILL)
            c.proc.wait()

    def run(self) -> int:
        self.start()
        try:
            code = self.supervise()
        finally:
            self.shutdown()
            self.forker.close()
            self.ports.close()
        from sluice.plots import write_run_plots  # matplotlib: only once the run is over

        learner = self._child("learner")
        plots = write_run_plots(self.run_dir)
        if plots:
            self.console.print(f"plots: {', '.join(p.name for p in plots)} in {plots[0].parent}")
        self.console.print(f"run directory: {self.run_dir} (learner exit {learner.proc.returncode})")
        return code


def _signal_group(proc: RoleProcess, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _progress_info(r: dict) -> str:
    episodic = f"return {r['episode_return_mean']:.1f}  " if "episode_return_mean" in r else ""
    return (
        episodic + f"reward {r.get('reward_mean', float('nan')):.3f}  "
        f"{r.get('samples_per_s', 0.0):.0f} samples/s  "
        f"staleness {r.get('staleness_mean', 0.0):.2f} (max {r.get('staleness_max', 0):.0f})  "
        f"dropped {r.get('total_dropped_stale', 0)}  wait {100 * r.get('wait_frac', 0.0):.0f}%"
    )


class Stoppable(Protocol):
    stop: threading.Event

    def run(self) -> int: ...


def run_until_signalled(launcher: Stoppable) -> int:
    """`launcher.run()`, with SIGINT / SIGTERM setting `launcher.stop` (it then stops every
    role in order) instead of raising in the middle of it."""

    def on_signal(signum, frame):  # noqa: ARG001
        launcher.stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return launcher.run()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def run_local(cfg: RunConfig, show_progress: bool = True) -> int:
    return run_until_signalled(LocalLauncher(cfg, show_progress=show_progress))
