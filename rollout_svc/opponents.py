"""A pool of a policy's earlier versions that a rollout service serves as an opponent.

Self-play against the past (docs/multi_agent.md): the service keeps a copy of the weights of
every `every`-th version it receives, the newest `size` of them plus version 0, which stays
as a fixed reference (win rate against it is how progress shows). Each batch draws one
opponent: the current version with chance `latest`, else a kept version uniformly. The pool
lives in the service's memory, filled from the same weight channel the policy's engine reads,
so it needs no shared file system; a restarted service starts it again from the version it
first receives.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from sluice.config.task import OpponentPoolConfig
from sluice.rollout_svc.engines.base import Engine, WeightUpdate


def _copy(tensor: Any) -> Any:
    """A copy that outlives the receive buffer the tensor may be a view of."""
    return tensor.detach().clone() if hasattr(tensor, "detach") else np.array(tensor, copy=True)


class OpponentPool:
    """Kept versions of one policy and the engine that plays the one drawn for a batch."""

    def __init__(self, cfg: OpponentPoolConfig, engine: Engine, seed: int) -> None:
        self.cfg = cfg
        self.engine = engine  # its own engine: the policy's engine keeps the current weights
        self.rng = random.Random(seed)
        self.kept: dict[int, list[tuple[str, Any]]] = {}  # by version, oldest first

    def offer(self, update: WeightUpdate) -> None:
        """A version of the policy arrived: keep a copy if it is one the pool samples."""
        v = update.version
        if v in self.kept or (v != 0 and v % self.cfg.every != 0):
            return
        self.kept[v] = [(name, _copy(t)) for name, t in update.tensors]
        past = [k for k in self.kept if k != 0]
        while len(past) > self.cfg.size:
            del self.kept[past.pop(0)]

    def draw(self) -> int | None:
        """Load the opponent of the next batch into the pool's engine and return its version;
        None: the current version plays (on the policy's own engine)."""
        if not self.kept or self.rng.random() < self.cfg.latest:
            return None
        version = self.rng.choice(list(self.kept))
        if self.engine.version != version:
            self.engine.load_weights(self.kept[version], version)
        return version
