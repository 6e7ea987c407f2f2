"""Learning-rate schedule: linear warmup, then constant, linear or cosine decay to 0."""

from __future__ import annotations

import math
from collections.abc import Callable

from sluice.config.learner import LearnerConfig


def lr_factor(lc: LearnerConfig, total_updates: int) -> Callable[[int], float]:
    """Multiplier of the peak lr at optimizer update `step` (torch LambdaLR convention)."""
    warmup = lc.warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if lc.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_updates - warmup))
        if lc.lr_schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
