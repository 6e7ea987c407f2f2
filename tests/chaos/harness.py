"""The chaos suite's harness: a whole run with a fault (or several, one after another), and the
account of what it did.

A run is the quickstart with two shards, two rollout services, checkpoints every 10 steps, the
audit trail (`learner.audit_consumed`) and the experience archive (`buffer.archive`, with small
segments so compaction archives during the run). At step `at_step` one role is killed
(`kill -9`) or paused (`SIGSTOP` for the fault's `pause_s`, then `SIGCONT`); a later fault of the same run
strikes at its own step, once the earlier one's victim is back. Afterwards the run is accounted
for by id (`account`): it finished by itself, no trajectory was trained twice along the
surviving lineage, every trajectory a shard acknowledged (exported with its fate) was trained,
skipped or dropped by the learner, dropped as stale by a shard, or is still held; the version
sequence has no gap or repeat, the staleness bound held, the stale-drop rate came back (over
the second half of the steps after the step the last fault struck at, which the wait for earlier
victims can put well past its `at_step`), no
process or port outlived the run, and under Ray a killed role's ports stayed held (its bundle's
PortKeeper) until its replacement bound them. `python tests/chaos/run.py` prints the table for both
launchers; tests/chaos/test_chaos.py runs the bounded set CI runs (its docstring).
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import pyarrow.parquet as pq
from helpers.run_state import alive, launcher_events, port_is_free, role_pids, run_ports

from sluice.experience import export_experience
from sluice.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
STEPS, BATCH, BOUND = 80, 128, 1
OVERRIDES = (
    "rollout.engine=hf",
    "buffer.shards=2",
    "learner.checkpoint_every=10",
    "learner.audit_consumed=true",
    "buffer.archive=true",
    "buffer.segment_bytes=65536",
    "buffer.compact_min_bytes=65536",
)


@dataclass(frozen=True)
class Fault:
    kind: Literal["kill", "stop"]  # kill -9, or SIGSTOP for pause_s then SIGCONT
    role: str  # its name in the run: rollout-0, buffer-0, learner
    # 12 s: past the control client's 10.5 s ADMIT time-out (the re-send path runs) and weight
    # sync's 5 s liveness and 10 s ready time-outs, short of the 30 s service and sync time-outs
    pause_s: float = 12.0

    @property
    def name(self) -> str:
        return f"{'kill -9' if self.kind == 'kill' else f'SIGSTOP {self.pause_s:g} s'} {self.role}"


FAULTS = [
    Fault("kill", "rollout-0"),
    Fault("kill", "buffer-0"),
    Fault("kill", "learner"),
    Fault("stop", "buffer-0"),
    Fault("stop", "learner"),
]


@dataclass
class Report:
    launcher: str
    faults: list[Fault]
    exit_code: int | None
    wall_s: float
    finished: bool = False  # exit 0 and versions 1..steps, each once
    restarted: list[str] = field(default_factory=list)
    moved: list[str] = field(default_factory=list)  # restarted on another node than placed (Ray)
    trained: int = 0
    duplicates: int = 0  # ids trained twice along the surviving lineage
    stored: int = 0  # trajectories the shards acknowledged (the export's rows)
    lost: int = 0  # acknowledged, yet neither trained, skipped, dropped nor held
    fates: dict[str, int] = field(default_factory=dict)
    staleness_max: int = 0
    violations: int = 0
    drops_before: float = 0.0  # stale drops per step before the first fault
    drops_after: float = 0.0  # ... over the second half of what followed it
    orphans: list[int] = field(default_factory=list)
    busy_ports: list[int] = field(default_factory=list)
    # under Ray, a killed role that serves on reserved ports: its bundle's PortKeeper still held
    # them just after the kill, and the restarted role was given the same keeper (None: no such role)
    ports_kept: bool | None = None

    @property
    def drops_recovered(self) -> bool:
        """Back within 2x of before (or under 5% of a batch per step, where before was ~0)."""
        return self.drops_after <= max(2 * self.drops_before, 0.05 * BATCH)

    def failures(self) -> list[str]:
        bad = [] if self.finished else [f"did not finish (exit {self.exit_code})"]
        bad += [f"{self.duplicates} trained twice"] if self.duplicates else []
        bad += [f"{self.lost} lost"] if self.lost else []
        bad += [] if self.staleness_max <= BOUND and not self.violations else ["staleness bound broken"]
        bad += (
            [] if self.drops_recovered else [f"stale drops {self.drops_before:.1f} -> {self.drops_after:.1f}"]
        )
        bad += [f"restarted away from its node: {self.moved}"] if self.moved else []
        bad += [f"orphans {self.orphans}"] if self.orphans else []
        bad += [f"ports still bound {self.busy_ports}"] if self.busy_ports else []
        bad += ["its ports were not held across the restart"] if self.ports_kept is False else []
        if all(f.kind == "stop" for f in self.faults) and self.restarted:
            bad.append(f"a pause cost restarts of {self.restarted}")
        killed = [f.role for f in self.faults if f.kind == "kill"]
        bad += [f"{role} was not restarted" for role in killed if role not in self.restarted]
        return bad

    @property
    def fault(self) -> str:
        return ", ".join(f.name for f in self.faults)

    def as_dict(self) -> dict:
        return {**asdict(self), "failures": self.failures()}


def start(
    launcher: str, run_dir: Path, log: Path, steps: int, extra: tuple[str, ...] = ()
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "sluice.cli",
        launcher,
        str(QUICKSTART),
        f"run.dir={run_dir}",
        *OVERRIDES,
        *extra,
    ]
    cmd.append(f"learner.total_steps={steps}")
    if launcher == "ray":
        cmd.append("ray.local_num_cpus=6")
    with log.open("wb") as out:
        return subprocess.Popen(
            [*cmd, "--no-progress"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def steps_logged(run_dir: Path) -> int:
    return len(read_jsonl(run_dir / "metrics" / "learner.jsonl"))


def wait_for(predicate, proc: subprocess.Popen, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended (exit {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.25)


def inject(fault: Fault, pid: int) -> None:
    if fault.kind == "kill":
        os.kill(pid, signal.SIGKILL)
        return
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(fault.pause_s)  # the pause is the scenario
    finally:
        os.kill(pid, signal.SIGCONT)


def run_with_fault(
    launcher: str,
    fault: Fault,
    work: Path,
    at_step: int = 30,
    steps: int = STEPS,
    timeout_s: float = 900,
    extra: tuple[str, ...] = (),
) -> Report:
    """One run of `steps` under `launcher` (run | ray) with `fault` at `at_step`, accounted for
    (`extra`: config overrides after the suite's own)."""
    return run_with_faults(launcher, [(at_step, fault)], work, steps, timeout_s, extra)


def run_with_faults(
    launcher: str,
    faults: list[tuple[int, Fault]],
    work: Path,
    steps: int = STEPS,
    timeout_s: float = 900,
    extra: tuple[str, ...] = (),
) -> Report:
    """One run of `steps` with each `(at_step, fault)` in turn, accounted for: a fault waits for
    its step and for every role an earlier fault killed to be back (restarted)."""
    run_dir, log = work / "run", work / "launcher.log"
    t0 = time.monotonic()
    proc = start(launcher, run_dir, log, steps, extra)
    seen: set[int] = set()
    killed: set[str] = set()
    held_at_kill: dict[str, bool] = {}  # Ray: was the role's PortKeeper alive just after the kill
    struck_at: list[int] = []  # the steps logged when each fault was injected (at or past at_step)
    try:
        for at_step, fault in faults:
            pids, held = strike(proc, run_dir, at_step, fault, frozenset(killed))
            struck_at.append(steps_logged(run_dir))
            seen |= pids
            killed |= {fault.role} if fault.kind == "kill" else set()
            if held is not None:
                held_at_kill[fault.role] = held
        code = proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    seen |= set(role_pids(run_dir).values())
    report = Report(launcher, [f for _, f in faults], code, time.monotonic() - t0)
    if held_at_kill:
        placed, back = port_keepers(run_dir, "placed"), port_keepers(run_dir, "restarted")
        report.ports_kept = all(held and back.get(r) == placed[r] for r, held in held_at_kill.items())
    account(report, run_dir, work / "experience.parquet", struck_at, steps)
    report.orphans = sorted(p for p in seen if alive(p))
    report.busy_ports = [p for p in run_ports(run_dir) if not port_is_free(p)]
    return report


def strike(
    proc: subprocess.Popen, run_dir: Path, at_step: int, fault: Fault, back: frozenset[str]
) -> tuple[set[int], bool | None]:
    """`fault` once the learner logged `at_step` steps and the roles in `back` were restarted.
    Returns the run's pids just before it, and under Ray for a kill whether the victim's
    PortKeeper was still alive just after it (None: no keeper)."""
    wait_for(lambda: steps_logged(run_dir) >= at_step, proc, 300, f"{at_step} learner steps")
    wait_for(lambda: back <= restarted_roles(run_dir), proc, 300, f"restarts of {sorted(back)}")
    keepers = port_keepers(run_dir, "placed")
    pids = set(role_pids(run_dir).values()) | set(keepers.values())
    inject(fault, role_pids(run_dir)[fault.role])
    return pids, (alive(keepers[fault.role]) if fault.kind == "kill" and fault.role in keepers else None)


def restarted_roles(run_dir: Path) -> set[str]:
    return {e["role"] for e in launcher_events(run_dir, "restarted")}


def port_keepers(run_dir: Path, event: str) -> dict[str, int]:
    """Role -> the pid of the Ray PortKeeper holding its ports, as its `event` records say."""
    return {e["role"]: e["ports_held_by"] for e in launcher_events(run_dir, event) if "ports_held_by" in e}


def lineage(records: list[dict]) -> list[dict]:
    """The audit records of the surviving lineage: each resume cuts what came after its
    checkpoint (trained by a learner whose later state was lost)."""
    out: list[dict] = []
    for r in records:
        if "resumed_from" in r:
            out = [x for x in out if x["version"] <= r["resumed_from"]]
        else:
            out.append(r)
    return out


def account(report: Report, run_dir: Path, parquet: Path, at_steps: list[int], steps: int) -> None:
    logged = read_jsonl(run_dir / "metrics" / "learner.jsonl")
    versions = [s["version"] for s in logged]
    report.finished = report.exit_code == 0 and versions == list(range(1, steps + 1))
    events = read_jsonl(run_dir / "metrics" / "launcher.jsonl")
    report.restarted = [e["role"] for e in events if e.get("event") == "restarted"]
    placed = {e["role"]: e.get("node_id") for e in events if e.get("event") == "placed"}
    report.moved = [
        e["role"]
        for e in events
        if e.get("event") == "restarted" and e.get("node_id") != placed.get(e["role"])
    ]
    audit = lineage(read_jsonl(run_dir / "metrics" / "consumed.jsonl"))
    trained = [i for r in audit for i in r["trained"]]
    used = {i for r in audit for k in ("trained", "skipped", "dropped") for i in r.get(k, [])}
    report.trained, report.duplicates = len(trained), len(trained) - len(set(trained))
    export_experience(run_dir, parquet, "parquet")
    rows = pq.read_table(parquet, columns=["traj_id", "fate"]).to_pylist()
    fate = {r["traj_id"]: r["fate"] for r in rows}
    report.stored = len(fate)
    report.fates = {f: sum(1 for v in fate.values() if v == f) for f in sorted(set(fate.values()))}
    acked_unused = [i for i, f in fate.items() if f == "acked" and i not in used]
    report.lost = len(acked_unused) + len(set(trained) - set(fate))
    report.staleness_max = max(s["staleness_max"] for s in logged) if logged else -1
    report.violations = logged[-1]["total_violations"] if logged else -1
    drops = [s.get("dropped_stale", 0) for s in logged]
    first, last = at_steps[0], at_steps[-1]
    report.drops_before = statistics.fmean(drops[5:first]) if len(drops) > first else float("nan")
    settled = last + (steps - last) // 2  # the second half of what followed the last fault
    report.drops_after = statistics.fmean(drops[settled:]) if len(drops) > settled else float("nan")


def table(reports: list[Report]) -> str:
    """The summary, one row per run."""
    head = (
        f"{'launcher':8} {'fault':33} {'ok':4} {'exit':>4} {'wall s':>6} {'restarted':24} {'trained':>7} "
        f"{'dup':>3} {'stored':>6} {'lost':>4} {'stale before/after':>18} {'stal.':>5} {'orph.':>5} "
        f"{'ports':>5}"
    )
    lines = [head, "-" * len(head)]
    for r in reports:
        lines.append(
            f"{r.launcher:8} {r.fault:33} {'yes' if not r.failures() else 'NO':4} {r.exit_code!s:>4} "
            f"{r.wall_s:6.0f} {','.join(r.restarted) or '-':24} {r.trained:7d} {r.duplicates:3d} "
            f"{r.stored:6d} {r.lost:4d} {r.drops_before:8.1f} / {r.drops_after:7.1f} {r.staleness_max:5d} "
            f"{len(r.orphans):5d} {({None: '-', True: 'kept', False: 'LOST'})[r.ports_kept]:>5}"
        )
        lines += [f"    {f}" for f in r.failures()]
    return "\n".join(lines)
