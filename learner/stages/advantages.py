"""Advantage estimators over a batch's rewards: each a pure tensor function, tested by hand
against its paper's formula (docs/workflows.md maps them)."""

from __future__ import annotations

import torch

from sluice.learner.dist import DistContext


def group_mean(values: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the mean of each sample's group, the group's size), per sample."""
    n = int(group_index.max()) + 1 if len(group_index) else 0
    count = torch.zeros(n, dtype=values.dtype, device=values.device).index_add_(
        0, group_index, torch.ones_like(values)
    )
    total = torch.zeros(n, dtype=values.dtype, device=values.device).index_add_(0, group_index, values)
    return (total / count)[group_index], count[group_index]


def rloo_advantages(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): r_i - mean_{j != i} r_j = G/(G-1) (r_i - mean); a group of
    one gets 0."""
    mean, size = group_mean(rewards, group_index)
    return torch.where(size > 1, (rewards - mean) * size / (size - 1).clamp(min=1), torch.zeros_like(rewards))


def batch_whitened(values: torch.Tensor, n: int, dist: DistContext, eps: float) -> torch.Tensor:
    """(x - mean) / (std + eps) with mean and std over every rank's `n` values (REINFORCE++'s
    global batch normalisation); every rank calls it, one without data with n = 0."""
    flat = (values.double() if n else values.new_zeros(0).double()).cpu()
    sums = dist.all_reduce(
        torch.stack([flat.sum(), (flat**2).sum(), torch.tensor(float(n), dtype=torch.float64)])
    )
    count = sums[2].clamp(min=1)
    mean = sums[0] / count
    std = (sums[1] / count - mean**2).clamp(min=0).sqrt()
    return ((values - mean.to(values.device)) / (std.to(values.device) + eps)).to(values.dtype)
