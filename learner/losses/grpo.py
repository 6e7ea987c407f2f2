"""GRPO: group-normalised advantages and a token-level policy gradient with truncated
importance sampling against the behaviour policy.

With one optimizer step per batch, the proximal policy of PPO is the current policy itself,
so the clipped PPO ratio is 1 at the point the gradient is taken and the off-policy part is
the behaviour correction: each token's gradient is weighted by
    w = min(pi_theta(a|s) / mu(a|s), is_cap)        (detached; truncated IS, as in TIS/IMPALA)
giving the surrogate  L = -sum_t w_t * A * log pi_theta(a_t|s_t) / #tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sluice.learner.losses.aggregate import Aggregation, Denominator, aggregate
from sluice.learner.losses.base import LossOutput


def group_mean(values: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the mean of each sample's group, the group's size), per sample."""
    n = int(group_index.max()) + 1 if len(group_index) else 0
    count = torch.zeros(n, dtype=values.dtype, device=values.device).index_add_(
        0, group_index, torch.ones_like(values)
    )
    total = torch.zeros(n, dtype=values.dtype, device=values.device).index_add_(0, group_index, values)
    return (total / count)[group_index], count[group_index]


def group_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-4, normalize_std: bool = True
) -> torch.Tensor:
    """(r - mean_group) / (std_group + eps) per sample; `group_index` holds 0..G-1.
    std is the unbiased sample std (a group of one gets advantage 0)."""
    mean, size = group_mean(rewards, group_index)
    centred = rewards - mean
    if not normalize_std:
        return centred
    sq = group_mean(centred**2, group_index)[0] * size  # the group's sum of squares
    std = torch.sqrt(sq / (size - 1).clamp(min=1))
    return centred / (std + eps)


def group_indices(group_ids: Sequence[str]) -> torch.Tensor:
    """Map group id strings to 0..G-1 in order of first appearance."""
    index: dict[str, int] = {}
    return torch.tensor([index.setdefault(g, len(index)) for g in group_ids], dtype=torch.long)


def grpo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    is_cap: float,
    mode: Aggregation = "token",
    denom: Denominator | None = None,
) -> LossOutput:
    """logprobs, behaviour_logprobs, mask: [B, T]; advantages: [B] or [B, T]. `denom` holds the counts
    of the whole batch when this is one piece of it (default: this batch's own counts).
    Metrics (detached, where the loss is: no host sync per micro-batch): is_weight_mean,
    is_truncated_frac (tokens whose IS weight hit the cap), log_ratio_abs_mean (mean
    |log pi_theta - log mu|, a staleness/mismatch gauge)."""
    denom = denom or Denominator.of(mask)
    mask = mask.to(logprobs.dtype)
    n_tokens = max(denom.tokens, 1.0)
    log_ratio = (logprobs.detach() - behaviour_logprobs) * mask
    weight = torch.exp(log_ratio).clamp(max=is_cap)
    adv = advantages if advantages.dim() == 2 else advantages[:, None]  # per token (GAE) or sequence
    surrogate = weight * adv * logprobs
    loss = aggregate(-surrogate, mask, mode, denom)
    with torch.no_grad():
        truncated = ((torch.exp(log_ratio) >= is_cap).to(mask.dtype) * mask).sum() / n_tokens
        metrics = {
            "is_weight_mean": (weight * mask).sum() / n_tokens,
            "is_truncated_frac": truncated,
            "log_ratio_abs_mean": log_ratio.abs().sum() / n_tokens,
        }
    return LossOutput(loss, metrics)
