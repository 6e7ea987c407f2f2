"""What a learner step optimises, independent of how ranks and micro-batches split it.

An objective turns a rank's trajectories into a prepared batch (`prepare`: collate, compute
what needs no gradient: proximal log-probs, values, advantages), cuts it into pieces
(`split` into minibatches, `micro` into micro-batches), and gives the loss of a piece as its
share of the mean over the whole minibatch (`loss`, with the global `Denominator`).

Every rank calls `prepare`, `split`, `micro` and `loss` the same number of times even when it
has no data (a piece may be empty: its loss is a zero-weighted forward of a dummy input), so
collectives inside the model (DDP hooks, ZeRO-3 gathers) line up across ranks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from sluice.learner.dist import DistContext
from sluice.learner.losses.aggregate import Denominator
from sluice.trajectory import Trajectory

P = TypeVar("P")  # a prepared batch or a piece of one

Stats = dict[str, torch.Tensor]  # detached scalars, each a share of a global mean (summable)


class Objective(ABC, Generic[P]):
    whole_groups: bool  # ranks must receive whole groups (group-normalised advantages)

    @abstractmethod
    def cost(self, traj: Trajectory) -> int:
        """Work of one trajectory (tokens or steps), for balancing ranks."""

    @abstractmethod
    def prepare(self, module: torch.nn.Module, trajs: Sequence[Trajectory], dist: DistContext) -> P: ...

    @abstractmethod
    def split(self, batch: P, n: int, generator: torch.Generator) -> list[P]:
        """Exactly `n` minibatches (shuffled when n > 1)."""

    @abstractmethod
    def micro(self, batch: P, m: int) -> list[P]:
        """Exactly `m` micro-batches of near-equal work."""

    def without_inert(self, piece: P) -> P | None:
        """`piece` without the rows whose loss terms have exactly 0 gradient, which the step may
        leave out of its forward and backward; None to train it whole (the default)."""
        return None

    @abstractmethod
    def counts(self, piece: P) -> tuple[float, float]:
        """(tokens or steps, sequences) of a piece, for the global denominator."""

    @abstractmethod
    def loss(self, module: torch.nn.Module, piece: P, denom: Denominator) -> tuple[torch.Tensor, Stats]: ...

    def max_stats(self) -> tuple[str, ...]:
        """Names in the stats that are maxima (reduced with max, not summed)."""
        return ()

    def after_update(self) -> dict[str, float]:
        """After each optimizer update of the policy: step what else the objective trains (an
        LLM workflow's critic). Returns statistics of that update."""
        return {}

    def save(self, directory: Path) -> None:
        """Into a checkpoint being written (collective): what else the objective trains."""

    def load(self, directory: Path) -> None:
        """From the checkpoint being resumed."""


def rows(n: int, parts: int, generator: torch.Generator | None) -> list[torch.Tensor]:
    """`parts` index tensors covering 0..n-1 (a random permutation when a generator is given)."""
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    return list(torch.tensor_split(order, parts))


def take_rows(value: Any, index: torch.Tensor) -> Any:
    """Rows `index` of a tensor (dim 0) or of a list; anything else unchanged."""
    if isinstance(value, torch.Tensor):
        return value[index]
    if isinstance(value, list):
        return [value[i] for i in index.tolist()]
    return value
