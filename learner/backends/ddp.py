"""torch DistributedDataParallel (or the bare model in a group of one) with AdamW.

DDP averages gradients over ranks; each rank's loss is its share of the global mean, so the
loss is multiplied by the world size before backward (the average of K shares times K is
the sum, i.e. the gradient of the global mean). Micro-batches before the last of an update run
under `no_sync()`: gradients accumulate locally and are all-reduced once.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from sluice.config.learner import LearnerConfig
from sluice.learner.backends.base import TrainBackend
from sluice.learner.dist import DistContext
from sluice.learner.schedule import lr_factor


class DDPBackend(TrainBackend):
    def __init__(
        self, lc: LearnerConfig, model: torch.nn.Module, dist: DistContext, total_updates: int
    ) -> None:
        self.lc = lc
        self.dist = dist
        self.model = model
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=lc.lr,
            betas=lc.betas,
            eps=lc.adam_eps,
            weight_decay=lc.weight_decay,
            # One fused kernel over every parameter: a third of the single-tensor loop's time on a
            # tiny model (measured 0.7 vs 2.1 ms). cpu and cuda have it; other devices loop.
            fused=dist.device.type in ("cpu", "cuda") or None,
        )
        self._foreach = dist.device.type in ("cpu", "cuda") or None  # clip_grad_norm_'s kernels
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(lc, total_updates))
        if dist.distributed:
            ids = [dist.device.index] if dist.device.type == "cuda" else None
            self.module = DistributedDataParallel(model, device_ids=ids)
        else:
            self.module = model

    def accumulate(self, sync: bool):
        if sync or not self.dist.distributed:
            return nullcontext()
        if not isinstance(self.module, DistributedDataParallel):  # what __init__ wraps it in
            raise TypeError(f"distributed DDP backend holds a {type(self.module).__name__}")
        return self.module.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.dist.world).backward()

    def step(self) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.lc.grad_clip, foreach=self._foreach
        )
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm.detach()

    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def full_params(self):
        return nullcontext()

    def save(self, directory: Path) -> None:
        if self.dist.is_main:  # replicated: one copy is the state of every rank
            torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")
            torch.save(self.scheduler.state_dict(), directory / "scheduler.pt")

    def load(self, directory: Path) -> None:
        self.optimizer.load_state_dict(torch.load(directory / "optimizer.pt", weights_only=True))
        self.scheduler.load_state_dict(torch.load(directory / "scheduler.pt", weights_only=True))
