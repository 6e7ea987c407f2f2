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

from sluice.config.run import RunConfig

# A CPU rollout service decodes small batches one token at a time: more services scale its
# throughput, intra-op threads barely do (measured: docs/architecture.md).
ROLLOUT_THREADS = 1


def available_cores() -> int:
    """Cores this process may run on (its affinity, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


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
