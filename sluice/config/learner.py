"""The learner: optimisation, loss and the staleness bound."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sluice.config.base import Section


class LossConfig(Section):
    type: Literal["grpo"] = "grpo"
    """grpo: group-normalised advantages, token-level policy gradient, truncated IS."""
    is_cap: float = Field(2.0, gt=0)
    """Truncated importance sampling: token weights pi_theta / mu are capped at this value."""
    adv_eps: float = Field(1e-4, gt=0)
    """Added to the group reward std before dividing."""
    normalize_std: bool = True
    """Divide group-centred rewards by the group std (GRPO); False gives Dr.GRPO-style advantages."""


class LearnerConfig(Section):
    total_steps: int = Field(300, ge=1)
    """Optimizer steps (= policy versions published) before the run ends."""
    batch_size: int = Field(128, ge=1)
    """Trajectories per optimizer step (whole groups: a multiple of rollout.group_size)."""
    lr: float = Field(5e-4, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    max_staleness: int = Field(2, ge=0)
    """The staleness bound: at learner version v no sample older than v - max_staleness is
    consumed. 0 is synchronous on-policy training; larger values let generation and training
    overlap more at the price of more off-policy correction."""
    loss: LossConfig = LossConfig()
    """The policy loss."""
    get_wait_ms: int = Field(200, ge=0)
    """How long one GET waits at the shard for data before returning empty."""
    checkpoint_every: int = Field(0, ge=0)
    """Save a checkpoint every k steps (0: only the final one)."""
    log_every: int = Field(1, ge=1)
    """Write a metrics line every k steps."""
    torch_threads: int = Field(1, ge=1)
    """intra-op threads of the learner process."""
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    """Where the learner trains: auto picks cuda, then npu, then cpu."""
