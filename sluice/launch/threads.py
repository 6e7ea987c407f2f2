"""How many intra-op (torch / OpenMP) threads each role process gets: the one rule every
launcher applies to `learner.torch_threads: auto` and `rollout.torch_threads: auto`.

On a host the launcher fills with every role (`sluice run`), the cores are split: each CPU
rollout service gets `ROLLOUT_THREADS`, the CPU learner group the rest, shared by its ranks,
never below one each. Roles on an accelerator do their arithmetic there and get one host
thread. A role started on its own (`sluice learner|rollout`, a Ray actor, a pod) takes the
cores it may run on: `OMP_NUM_THREADS` when set (Ray sets it to the actor's `num_cpus`), else
its CPU affinity. Why this split and these numbers: docs/architecture.md, "Cores and threads".
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

from sluice.config.run import RunConfig

if TYPE_CHECKING:
    from sluice.launch.plan import RoleSpec

# The variable a launcher sets to pin a role's process (`run_role` applies it): core ids, "0,3".
CPUS_ENV = "SLUICE_CPUS"
# ... and the cores of a learner rank's training thread (`pin_compute_thread`).
COMPUTE_CPUS_ENV = "SLUICE_COMPUTE_CPUS"

# A CPU rollout service decodes small batches one token at a time: more services scale its
# throughput, intra-op threads barely do (measured: docs/architecture.md).
ROLLOUT_THREADS = 1


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
    """The pinning environment of each role of a host-filling run (`sluice run`), by role
    name; a role not named is not pinned. With `run.pin_cores` and a CPU learner, each learner
    rank's training thread gets `learner.torch_threads` cores of its own (COMPUTE_CPUS_ENV) and
    every other thread of the run, the learner's helpers included, shares the rest (CPUS_ENV):
    a rollout's decode or a socket thread never preempts a step (docs/architecture.md, "Cores
    and threads"). Nothing is pinned where the learner's threads would leave no core over."""
    if not cfg.run.pin_cores or not _learner_on_cpu(cfg):
        return {}
    ranks = [s for s in specs if s.kind == "learner"]
    per_rank = int(cfg.learner.torch_threads) if cfg.learner.torch_threads != "auto" else 1
    if len(ranks) == len(specs) or per_rank * len(ranks) >= len(cores):
        return {}
    shared = ",".join(map(str, cores[per_rank * len(ranks) :]))
    plan = {spec.name: {CPUS_ENV: shared} for spec in specs}
    for i, spec in enumerate(ranks):
        own = cores[i * per_rank : (i + 1) * per_rank]
        plan[spec.name][COMPUTE_CPUS_ENV] = ",".join(map(str, own))
    return plan


def _cpu_set(name: str) -> set[int] | None:
    raw = os.environ.get(name, "").strip()
    if not raw or not hasattr(os, "sched_setaffinity"):
        return None
    return {int(c) for c in raw.split(",")}


def apply_cpus_env() -> None:
    """Pin this process to the cores in SLUICE_CPUS, set by the launcher from `plan_cores`:
    every thread it has (imports may have started some) and, by inheritance, every thread it
    starts later. Unset: leave the affinity as it is."""
    cpus = _cpu_set(CPUS_ENV)
    if cpus is not None:
        pin_process(cpus)


def pin_process(cpus: set[int]) -> None:
    """Every thread of this process (and what they start later) on `cpus`."""
    for tid in _thread_ids():
        _set_affinity(tid, cpus)


def shared_cores(plan: dict[str, dict[str, str]]) -> set[int] | None:
    """The cores `plan_cores` left to everything but the learner's training threads (where the
    launcher itself belongs); None when nothing is pinned."""
    for env in plan.values():
        return {int(c) for c in env[CPUS_ENV].split(",")}
    return None


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
            spare = cores - cpu_rollouts * int(rc.torch_threads)
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
        import torch

        return not torch.cuda.is_available()
    return engine == "hf"


def _learner_on_cpu(cfg: RunConfig) -> bool:
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
        """Threads started since the last call go to the shared cores (one listdir a call)."""
        if self.shared is None or not self._known:
            return
        new = _thread_ids() - self._known
        for tid in new:
            _set_affinity(tid, self.shared)
        self._known |= new


def _thread_ids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _set_affinity(tid: int, cpus: set[int]) -> None:
    try:
        os.sched_setaffinity(tid, cpus)
    except ProcessLookupError:  # the thread ended meanwhile
        pass
