"""Decoupled PPO (AReaL; Hilton et al. 2022): separate the behaviour policy from the proximal one.

Asynchronous rollouts are produced by a behaviour policy mu that may be several versions old.
Decoupled PPO clips the ratio against a *proximal* policy pi_prox (the learner's weights at
the start of this batch's updates, recomputed here) and corrects for mu != pi_prox with
truncated importance weights:

    w_t = min(pi_prox(a_t|s_t) / mu(a_t|s_t), is_cap)                 (detached)
    L   = -w_t * min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t),   r_t = pi / pi_prox

Without recomputation (pi_prox := mu) the weights are 1 and this is plain PPO against mu.
"""

from __future__ import annotations

import torch

from sluice.learner.losses.aggregate import Aggregation, Denominator, masked_sum
from sluice.learner.losses.base import LossOutput
from sluice.learner.losses.ppo import clipped_surrogate


def behaviour_weights(
    proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, is_cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w = min(exp(prox - mu), cap), truncated = raw weight above the cap). Detached."""
    raw = torch.exp((proximal_logprobs - behaviour_logprobs).detach())
    return raw.clamp(max=is_cap), raw > is_cap


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    is_cap: float,
    mode: Aggregation,
    denom: Denominator,
) -> LossOutput:
    """clipped_surrogate's metrics, and is_weight_mean, is_weight_max (behaviour weights over
    tokens), is_truncated_frac (share of tokens whose weight hit the cap)."""
    weights, truncated = behaviour_weights(proximal_logprobs, behaviour_logprobs, is_cap)
    out = clipped_surrogate(
        logprobs, proximal_logprobs.detach(), advantages, mask, clip_low, clip_high, mode, denom, weights
    )
    with torch.no_grad():
        n = max(denom.tokens, 1.0)
        m = mask.to(weights.dtype)
        out.metrics.update(
            is_weight_mean=masked_sum(weights, mask) / n,
            is_weight_max=(weights * m).max() if m.numel() else torch.zeros(()),
            is_truncated_frac=masked_sum(truncated.to(weights.dtype), mask) / n,
        )
    return out
