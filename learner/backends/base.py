"""The training backend of a learner group: how gradients are reduced and parameters updated.

The interface only: the implementations (ddp.py: torch DDP; deepspeed.py: ZeRO 1/2/3) and the
factory that picks one by `learner.backend` (`build_backend`, learner/backends/__init__.py)
live beside it, and this module imports neither. Every implementation takes the loss of one
micro-batch as its share of the mean over the *whole* learner batch (all ranks, all
micro-batches; see learner/losses/aggregate.py), so summing gradients over micro-batches and
averaging over ranks reproduces the single-process update exactly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from pathlib import Path

import torch


class TrainBackend(ABC):
    model: torch.nn.Module  # the bare model: parameter names as in the Hugging Face checkpoint
    module: torch.nn.Module  # what to call for forward passes (the wrapped model)

    @abstractmethod
    def accumulate(self, sync: bool) -> AbstractContextManager:
        """Context of one micro-batch's forward and backward; `sync` on the last one of an update."""

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None: ...

    @abstractmethod
    def step(self) -> torch.Tensor | float:
        """Clip, update, advance the lr schedule, clear gradients. Returns the gradient norm
        (a 0-d tensor where it was computed, so no host sync is forced here)."""

    @abstractmethod
    def lr(self) -> float: ...

    @abstractmethod
    def full_params(self) -> AbstractContextManager:
        """Inside: every parameter of `model` is whole on every rank (ZeRO-3 gathers)."""

    @abstractmethod
    def save(self, directory: Path) -> None:
        """Optimizer and scheduler state (collective: every rank calls it)."""

    @abstractmethod
    def load(self, directory: Path) -> None: ...
