"""A pool of a policy's earlier versions that a rollout service serves as an opponent.

Self-play against the past (docs/multi_agent.md): the pool holds every `every`-th version of
the policy, the newest `size` of them plus version 0, which stays as a fixed reference (win rate
against it is how progress shows). Each batch draws one opponent: the current version with
chance `latest`, else a kept version uniformly, loaded into the pool's own engine.

Where the versions come from (`opponent_pool.source`):
- `received`: copies of the versions the service receives over the weight channel, in its
  memory. Needs no shared file system; a restarted service starts a new pool.
- `checkpoints`: the policy's checkpoints on disk (and the run's initial model as version 0),
  listed again at each draw and read when drawn. The pool outlives the service.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np

from sluice.config.task import OpponentPoolConfig
from sluice.rollout_svc.engines.base import Engine, WeightUpdate

Weights = list[tuple[str, Any]]


def _copy(tensor: Any) -> Any:
    """A copy that outlives the receive buffer the tensor may be a view of."""
    return tensor.detach().clone() if hasattr(tensor, "detach") else np.array(tensor, copy=True)


def checkpoint_versions(root: Path, initial: Path) -> dict[int, Path]:
    """version -> model directory: the initial model (0) and every finished `step_<v>` under
    `root` (a checkpoint still being written is a hidden temporary directory)."""
    found = {0: initial}
    for step in root.glob("step_*"):
        if step.is_dir() and step.name[5:].isdigit() and (step / "model.safetensors").is_file():
            found[int(step.name[5:])] = step
    return found


def read_weights(model_dir: Path) -> Weights:
    """A model directory's tensors, as the weight channel names them."""
    from safetensors.torch import load_file

    return list(load_file(str(model_dir / "model.safetensors")).items())


class OpponentPool:
    """Kept versions of one policy and the engine that plays the one drawn for a batch.
    `checkpoints`: (the policy's checkpoint root, its initial model directory), read with
    `source: checkpoints`."""

    def __init__(
        self,
        cfg: OpponentPoolConfig,
        engine: Engine,
        seed: int,
        checkpoints: tuple[Path, Path] | None = None,
    ) -> None:
        if cfg.source == "checkpoints" and checkpoints is None:
            raise ValueError("an opponent pool of checkpoints needs their directory")
        self.cfg = cfg
        self.engine = engine  # its own engine: the policy's engine keeps the current weights
        self.rng = random.Random(seed)
        self.checkpoints = checkpoints
        self.kept: dict[int, Weights | Path] = {}  # by version, oldest first

    def offer(self, update: WeightUpdate) -> None:
        """A version of the policy arrived: with `source: received`, keep a copy if it is one
        the pool samples."""
        v = update.version
        if self.cfg.source != "received" or v in self.kept or not self._samples(v):
            return
        self.kept[v] = [(name, _copy(t)) for name, t in update.tensors]
        self._trim()

    def draw(self) -> int | None:
        """Load the opponent of the next batch into the pool's engine and return its version;
        None: the current version plays (on the policy's own engine)."""
        if self.checkpoints is not None and self.cfg.source == "checkpoints":
            found = checkpoint_versions(*self.checkpoints)
            self.kept = {v: found[v] for v in sorted(found) if self._samples(v)}
            self._trim()
        if not self.kept or self.rng.random() < self.cfg.latest:
            return None
        version = self.rng.choice(list(self.kept))
        if self.engine.version != version:
            held = self.kept[version]
            self.engine.load_weights(read_weights(held) if isinstance(held, Path) else held, version)
        return version

    def _samples(self, version: int) -> bool:
        return version == 0 or version % self.cfg.every == 0

    def _trim(self) -> None:
        """The newest `size` versions besides version 0."""
        past = sorted(k for k in self.kept if k != 0)
        for v in past[: max(0, len(past) - self.cfg.size)]:
            del self.kept[v]
