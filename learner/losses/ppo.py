"""PPO: the clipped surrogate, the value loss and GAE.

With pi the policy being trained and pi_old the policy the ratio is taken against,
    r_t = pi(a_t|s_t) / pi_old(a_t|s_t)
    L_clip = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t) * w_t
where w_t is 1 for plain PPO (pi_old = the behaviour policy) and the truncated behaviour
weight pi_prox / mu for decoupled PPO (learner/losses/decoupled.py). clip_high > clip_low is
DAPO's clip-higher: more room for raising the probability of unlikely good tokens.
"""

from __future__ import annotations

import torch

from sluice.learner.losses.aggregate import Aggregation, Denominator, aggregate, masked_sum
from sluice.learner.losses.base import LossOutput


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    next_values: torch.Tensor,
    terminated: torch.Tensor,
    ended: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over [B, T] (time last). Returns (advantages, returns).

    next_values[t] is V of the state after step t (for a truncated step: of the final state
    the episode was cut at). terminated[t]: the episode ended in a terminal state (no
    bootstrap). ended[t]: the episode ended after step t for any reason (the recursion stops).
        delta_t = r_t + gamma * (1 - terminated_t) * next_values_t - values_t
        A_t     = delta_t + gamma * lam * (1 - ended_t) * A_{t+1}
    """
    not_term = 1.0 - terminated.to(values.dtype)
    cont = 1.0 - ended.to(values.dtype)
    delta = rewards + gamma * not_term * next_values - values
    adv = torch.zeros_like(values)
    running = torch.zeros_like(values[..., 0])
    for t in range(values.shape[-1] - 1, -1, -1):
        running = delta[..., t] + gamma * lam * cont[..., t] * running
        adv[..., t] = running
    return adv, adv + values


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    mode: Aggregation,
    denom: Denominator,
    weights: torch.Tensor | None = None,
) -> LossOutput:
    """All inputs [B, T] (advantages may be [B] and are broadcast over T). `weights` are
    detached per-token multipliers (decoupled PPO's behaviour weights). Metrics (detached):
    clip_frac (share of tokens where the clipped term was the one taken), ratio_mean (mean of
    r_t), approx_kl (mean of (r - 1) - log r, a KL(pi_old || pi) estimate)."""
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    if weights is not None:
        per_token = per_token * weights
    loss = aggregate(per_token, mask, mode, denom)
    with torch.no_grad():
        n = max(denom.tokens, 1.0)
        was_clipped = (clipped < unclipped).to(ratio.dtype)
        metrics = {
            "clip_frac": masked_sum(was_clipped, mask) / n,
            "ratio_mean": masked_sum(ratio, mask) / n,
            "approx_kl": masked_sum((ratio - 1.0) - log_ratio, mask) / n,
        }
    return LossOutput(loss, metrics)


def value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    mode: Aggregation,
    denom: Denominator,
    old_values: torch.Tensor | None = None,
    clip: float | None = None,
) -> torch.Tensor:
    """0.5 * (V - R)^2; with `clip`, the larger of that and the loss of V clipped to
    old_values +- clip (PPO's value clipping)."""
    err = (values - returns) ** 2
    if clip is not None and old_values is not None:
        clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        err = torch.maximum(err, (clipped - returns) ** 2)
    return 0.5 * aggregate(err, mask, mode, denom)
