"""DeepSpeed ZeRO (stage 1, 2 or 3) as the learner group's backend.

- The engine wraps our AdamW and LambdaLR (client optimizer and scheduler) and clips
  gradients (`gradient_clipping`).
- Gradient accumulation is ours, not DeepSpeed's: `managed_gradient_accumulation: false`
  makes every `step()` the accumulation boundary, so an update may have any number of
  micro-batches (the same on every rank: stage 2/3 reduce during each backward).
- ZeRO averages gradients over ranks, like DDP: the loss share is scaled by the world size.
- Stage 3 partitions parameters: publishing weights and saving the Hugging Face model run
  inside `full_params()` (deepspeed.zero.GatheredParameters), a collective every rank enters.
- Optimizer state (partitioned) is saved with `engine.save_checkpoint` under `deepspeed/`.
On CPU the collective backend is gloo (deepspeed.init_distributed in learner/dist.py).
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch

from sluice.config.learner import LearnerConfig
from sluice.learner.backends.base import TrainBackend
from sluice.learner.dist import DistContext
from sluice.learner.schedule import lr_factor


def deepspeed_config(lc: LearnerConfig, dtype: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,  # bookkeeping only: batches are ours
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": lc.grad_clip,
        "zero_optimization": {"stage": lc.zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": dtype == "bfloat16"},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class DeepSpeedBackend(TrainBackend):
    def __init__(
        self, lc: LearnerConfig, model: torch.nn.Module, dist: DistContext, total_updates: int, dtype: str
    ) -> None:
        import deepspeed

        self.lc = lc
        self.dist = dist
        self.model = model
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=lc.lr, betas=lc.betas, eps=lc.adam_eps, weight_decay=lc.weight_decay
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(lc, total_updates))
        # DeepSpeed annotates lr_scheduler as torch's legacy _LRScheduler; LambdaLR derives from its
        # successor LRScheduler, which DeepSpeed takes at run time (a gap in DeepSpeed's typing).
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,  # pyright: ignore[reportArgumentType]
            config=deepspeed_config(lc, dtype),
        )
        self.module = self.engine

    def accumulate(self, sync: bool):
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss * self.dist.world, scale_wrt_gas=False)

    def step(self) -> float:
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def full_params(self):
        if self.lc.zero_stage < 3:
            return nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None)

    def save(self, directory: Path) -> None:
        self.engine.save_checkpoint(str(directory / "deepspeed"), tag="state")

    def load(self, directory: Path) -> None:
        path, _ = self.engine.load_checkpoint(
            str(directory / "deepspeed"),
            tag="state",
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed state under {directory / 'deepspeed'}")
