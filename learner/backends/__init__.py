"""Training backends of a learner group, and `build_backend`, which picks one by
`learner.backend` (docs/architecture.md, "Learner groups"). The interface is in base.py; each
implementation is imported only when chosen (deepspeed is an optional dependency)."""

from __future__ import annotations

import torch

from sluice.config.learner import LearnerConfig
from sluice.learner.backends.base import TrainBackend
from sluice.learner.dist import DistContext

__all__ = ["TrainBackend", "build_backend"]


def build_backend(
    lc: LearnerConfig, model: torch.nn.Module, dist: DistContext, total_updates: int, dtype: str
) -> TrainBackend:
    if lc.backend == "deepspeed":
        from sluice.learner.backends.deepspeed import DeepSpeedBackend

        return DeepSpeedBackend(lc, model, dist, total_updates, dtype)
    from sluice.learner.backends.ddp import DDPBackend

    return DDPBackend(lc, model, dist, total_updates)
