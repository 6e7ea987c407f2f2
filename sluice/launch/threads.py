"""How many intra-op (torch / OpenMP) threads each role process gets, and where its threads
run: the one rule every launcher applies to `learner.torch_threads: auto` and
`rollout.torch_threads: auto`, and the placement `sluice run` gives the roles it packs on one
host (`run.pin_cores`: `plan_cores`, `apply_placement`, `ComputePinning`).

On a host the launcher fills with every role (`sluice run`), the cores are split: each CPU
rollout service gets `ROLLOUT_THREADS`, the CPU learner group the rest, shared by its ranks,
never below one each. Roles on an accelerator do their arithmetic there and get one host
thread. A role started on its own (`sluice learner|rollout`, a Ray actor, a pod) takes the
cores it may run on: `OMP_NUM_THREADS` when set (Ray sets it to the actor's `num_cpus`), else
its CPU affinity; where no rollout computes on the CPU, the learner leaves HOST_WORK_CORES to the
shards and services. Why this split and these numbers: docs/architecture.md, "Cores and threads".
"""

from __future__ import annotations

import math
import os
import resource
import threading
import time
from typing import TYPE_CHECKING

from sluice.accelerators import cpu_only, cuda_available
from sluice.config.run import RunConfig

if TYPE_CHECKING:
    from sluice.launch.plan import RoleSpec

# The variables a launcher sets to place a role's threads (`apply_placement`): core ids, "0,3" ...
CPUS_ENV = "SLUICE_CPUS"
# ... the cores of a learner rank's training thread (`ComputePinning`) ...
COMPUTE_CPUS_ENV = "SLUICE_COMPUTE_CPUS"
# ... and the priority of a role that yields to the training threads: a nice value, or IDLE.
PRIORITY_ENV = "SLUICE_PRIORITY"
IDLE = "idle"
# Rollout services that compute on the CPU beside a pinned learner run as SCHED_IDLE (CFS weight
# 3 against the learner's 1024): they fill idle time and almost never take the training core
# from a runnable training thread. Nice 10 (weight 110) still took ~10% of it: 3x the training
# thread's preemptions (measured: docs/architecture.md, "Cores and threads"). Only where the
# learner leaves cores outside its training threads: on cores a busy learner fills, a SCHED_IDLE
# service would get nothing for a whole step (its heartbeats too), so there it runs at nice 10.
COMPUTING_PRIORITY = IDLE
# Shards and services that only sleep (sim, generation on an accelerator) serve requests and
# wake often for little work: nice 10 lets a waking one preempt a busy core's lower-weight
# task soon, where SCHED_IDLE (or SCHED_BATCH) would wait for it.
SERVING_PRIORITY = "10"

# How often, at most, a learner rank looks for threads started on its training cores: a look is
# one stat of its thread directory (the thread count), and a listdir only when the count moved
# or FULL_SWEEP_EVERY_S has passed (a thread that ended as another started leaves it equal).
SWEEP_EVERY_S = 0.25
FULL_SWEEP_EVERY_S = 2.0

# A CPU rollout service decodes small batches one token at a time: more services scale its
# throughput, intra-op threads barely do (measured: docs/architecture.md).
ROLLOUT_THREADS = 1
# Where no rollout computes on the CPU (sim, or generation on an accelerator), the cores a CPU
# learner leaves to the shards and the services' own work (decode their replies, build and PUT
# trajectories, admission): OpenMP threads stall whenever another process takes one of their
# cores (measured: docs/architecture.md, "Cores and threads").
HOST_WORK_CORES = 1


def available_cores() -> int:
    """Cores this process may run on (its affinity, which containers and taskset narrow)."""
    return len(core_ids())


def core_ids() -> list[int]:
    """The ids of the cores this process may run on, in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def plan_cores(cfg: RunConfig, specs: list[RoleSpec], cores: list[int]) -> dict[str, dict[str, str]]:
    """The placement environment of each role of a host-filling run (`sluice run`), by role
    name; a role not named is left alone. With `run.pin_cores` and a CPU learner, each learner
    rank's training thread gets `learner.torch_threads` cores of its own (COMPUTE_CPUS_ENV) and
    its helper threads the other cores (CPUS_ENV); every other role may run anywhere but at a
    lower priority (PRIORITY_ENV: SCHED_IDLE for rollouts that compute on the CPU, nice 10 for
    shards and services that only sleep, and for every role where the learner fills the host).
    So a rollout's decode never preempts a training step, yet takes the training cores whenever
    the step leaves them idle, as it waits for data on a generation-bound run
    (docs/architecture.md, "Cores and threads"). Where the learner's threads would take every
    core (a group of one-thread ranks filling the host, or explicit thread counts), nothing is
    pinned, but the other roles still yield."""
    if not cfg.run.pin_cores or not _learner_on_cpu(cfg):
        return {}
    ranks = [s for s in specs if s.kind == "learner"]
    per_rank = int(cfg.learner.torch_threads) if cfg.learner.torch_threads != "auto" else 1
    if len(ranks) == len(specs):
        return {}
    fills = per_rank * len(ranks) >= len(cores)
    computing = COMPUTING_PRIORITY if _rollout_on_cpu(cfg) and not fills else SERVING_PRIORITY
    plan = {
        spec.name: {PRIORITY_ENV: computing if spec.kind == "rollout" else SERVING_PRIORITY}
        for spec in specs
        if spec.kind != "learner"
    }
    if fills:
        return plan
    shared = ",".join(map(str, cores[per_rank * len(ranks) :]))
    for i, spec in enumerate(ranks):
        own = cores[i * per_rank : (i + 1) * per_rank]
        plan[spec.name] = {CPUS_ENV: shared, COMPUTE_CPUS_ENV: ",".join(map(str, own))}
    return plan


def _cpu_set(name: str) -> set[int] | None:
    raw = os.environ.get(name, "").strip()
    if not raw or not hasattr(os, "sched_setaffinity"):
        return None
    return {int(c) for c in raw.split(",")}


def apply_placement() -> None:
    """This role's place from `plan_cores`, set by the launcher: every thread it has (imports
    may have started some) on the cores in CPUS_ENV, and at the priority in PRIORITY_ENV (a nice
    value, or IDLE for SCHED_IDLE); the threads it starts later inherit both. Unset: left as
    they are."""
    cpus = _cpu_set(CPUS_ENV)
    if cpus is not None:
        for tid in _thread_ids():
            _set_affinity(tid, cpus)
    priority = os.environ.get(PRIORITY_ENV, "").strip()
    if not priority:
        return
    if priority != IDLE and not priority.lstrip("-").isdigit():
        raise ValueError(f"{PRIORITY_ENV} must be a nice value or {IDLE!r}, got {priority!r}")
    for tid in _thread_ids():
        try:
            if priority == IDLE:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            else:
                os.setpriority(os.PRIO_PROCESS, tid, int(priority))
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def role_threads(setting: int | str) -> int:
    """A role's thread count: `setting` itself, or for `auto` (a role started on its own)
    the cores it may use."""
    if setting != "auto":
        return int(setting)
    omp = os.environ.get("OMP_NUM_THREADS", "")
    return int(omp) if omp.isdigit() and int(omp) > 0 else available_cores()


def plan_threads(cfg: RunConfig, cores: int) -> RunConfig:
    """Resolve `auto` thread counts for a run whose roles all share `cores` (local launcher)."""
    cfg = cfg.model_copy(deep=True)
    rc, lc = cfg.rollout, cfg.learner
    cpu_rollouts = rc.services if _rollout_on_cpu(cfg) else 0
    if rc.torch_threads == "auto":
        rc.torch_threads = ROLLOUT_THREADS if cpu_rollouts else 1
    if lc.torch_threads == "auto":
        if _learner_on_cpu(cfg):
            spare = cores - (cpu_rollouts * int(rc.torch_threads) if cpu_rollouts else HOST_WORK_CORES)
            groups = len(lc.policies) * lc.ranks
            lc.torch_threads = max(1, spare // groups)
        else:
            lc.torch_threads = 1
    return cfg


def _rollout_on_cpu(cfg: RunConfig) -> bool:
    """Env services and the hf engine compute on the CPU; vllm where there is no GPU; sim
    services only sleep."""
    from sluice.rollout_svc.engines.registry import resolve_engine

    if cfg.rollout.kind == "env":
        return True
    engine = resolve_engine(cfg.rollout.engine)
    if engine == "vllm":
        return not cuda_available()
    return engine == "hf"


def _learner_on_cpu(cfg: RunConfig) -> bool:
    if cfg.learner.device == "cpu" or (cfg.learner.device == "auto" and cpu_only()):
        return True  # known without importing torch (sluice/accelerators.py)
    from sluice.learner.dist import pick_device  # the learner's own choice of device

    return pick_device(cfg.learner.device).type == "cpu"


class ComputePinning:
    """A learner rank's training thread on cores of its own (COMPUTE_CPUS_ENV, when the
    launcher planned them), every other thread of the process on the shared cores (CPUS_ENV).

    `pin` moves the calling thread and starts torch's intra-op pool from it (the pool shares
    its cores); `sweep` moves threads started since (a lazily created worker, a new process
    group's socket threads) off the training cores: threads inherit their creator's affinity,
    and the creator is often the training thread. Without a plan both only set the thread count.
    """

    def __init__(self) -> None:
        self.compute = _cpu_set(COMPUTE_CPUS_ENV)
        self.shared = _cpu_set(CPUS_ENV)
        self._known: set[int] = set()
        self._swept_at = -math.inf
        self._listed_at = -math.inf
        self._count = 0  # threads at the last listdir

    def pin(self, threads: int) -> None:
        import torch

        if self.compute is None or self.shared is None:
            torch.set_num_threads(threads)
            return
        before = _thread_ids()
        os.sched_setaffinity(threading.get_native_id(), self.compute)
        torch.set_num_threads(threads)
        if threads > 1:  # start the pool now, from this thread, so that it is known
            torch.ones(256, 256) @ torch.ones(256, 256)
        pool = _thread_ids() - before
        self._known = before | pool | {threading.get_native_id()}
        for tid in before - {threading.get_native_id()}:
            _set_affinity(tid, self.shared)

    def sweep(self) -> None:
        """Threads started since the last look go to the shared cores. Called every step, it
        looks at most every SWEEP_EVERY_S: one listdir of the process's threads took ~0.45 ms,
        ~1% of a vs_trl step (py-spy), and threads start rarely once the run is going. It lists
        them only when their count moved (or after FULL_SWEEP_EVERY_S): CPython lets the GIL go
        around each entry a listdir reads, and a helper taking it there made the training
        thread wait ~11 times a second (perf, docs/architecture.md "Cores and threads")."""
        if self.shared is None or not self._known:
            return
        now = time.monotonic()
        if now - self._swept_at < SWEEP_EVERY_S:
            return
        self._swept_at = now
        count = _thread_count()
        if count == self._count and now - self._listed_at < FULL_SWEEP_EVERY_S:
            return
        self._listed_at, self._count = now, count
        new = _thread_ids() - self._known
        for tid in new:
            _set_affinity(tid, self.shared)
        self._known |= new


def thread_sleeps() -> int:
    """Times the calling thread has slept so far (voluntary context switches; Linux's
    RUSAGE_THREAD, 0 elsewhere). Around the learner's compute phase they count its waits to
    take the GIL back from a helper thread (its metric `compute_sleeps`)."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    return resource.getrusage(who).ru_nvcsw if who is not None else 0


def _thread_ids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _thread_count() -> int:
    """Threads of this process: one stat (a /proc/<pid>/task directory links each thread)."""
    return os.stat("/proc/self/task").st_nlink - 2


def _set_affinity(tid: int, cpus: set[int]) -> None:
    try:
        os.sched_setaffinity(tid, cpus)
    except ProcessLookupError:  # the thread ended meanwhile
        pass
