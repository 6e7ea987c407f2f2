"""Advantage estimators over a batch's rewards: each a pure tensor function, tested by hand
against its paper's formula (docs/workflows.md maps them)."""

from __future__ import annotations

import torch

from sluice.learner.dist import DistContext
from sluice.learner.losses.grpo import group_mean


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


def token_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over each row's trained tokens (mask 1, in order; other positions are skipped and get
    0). The reward r (one per row) comes on the last trained token, after which the episode has
    ended (V = 0). Returns (advantages, returns = advantages + values), both [B, T]:
        delta_t = [t last] r + gamma V_next(t) - V_t,   A_t = delta_t + gamma lam A_next(t)
    """
    m = mask.bool()
    adv = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    next_v = torch.zeros_like(values[:, 0])
    seen = torch.zeros_like(m[:, 0])  # a later trained token exists
    for t in reversed(range(values.shape[1])):
        here = m[:, t]
        reward = torch.where(seen, torch.zeros_like(rewards), rewards)
        delta = reward + gamma * next_v - values[:, t]
        a = delta + gamma * lam * running
        adv[:, t] = torch.where(here, a, torch.zeros_like(a))
        running = torch.where(here, a, running)
        next_v = torch.where(here, values[:, t], next_v)
        seen = seen | here
    return adv, (adv + values) * m


def masked_whitened(values: torch.Tensor, mask: torch.Tensor, dist: DistContext, eps: float) -> torch.Tensor:
    """`batch_whitened` over the positions where mask is 1 (all ranks); 0 elsewhere."""
    m = mask.bool()
    out = torch.zeros_like(values)
    out[m] = batch_whitened(values[m], int(m.sum()), dist, eps)
    return out
