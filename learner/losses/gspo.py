"""GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): PPO's clipped surrogate on a
sequence-level ratio instead of per-token ratios.

    s_i = exp( (1/|y_i|) sum_t [log pi(y_it) - log pi_old(y_it)] )      (the geometric mean)
    L   = -(1/G) sum_i min( s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i )

The ratio is a length-normalised sequence likelihood ratio, so one token's noise cannot blow up
a sequence's weight; clipping acts on whole sequences (the paper's eps are ~1e-4, not 0.2).
pi_old is the behaviour policy of the rollout, or the learner's proximal weights when the
workflow computes them.
"""

from __future__ import annotations

import torch

from sluice.learner.losses.aggregate import Denominator
from sluice.learner.losses.base import LossOutput


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    denom: Denominator,
) -> LossOutput:
    """logprobs, old_logprobs, mask: [B, T]; advantages: [B]. The loss is this piece's share of
    the mean over the minibatch's sequences (`denom.sequences`). Metrics: seq_ratio_mean,
    seq_clip_frac (sequences whose ratio left the clip range)."""
    m = mask.to(logprobs.dtype)
    tokens = m.sum(-1)
    log_ratio = ((logprobs - old_logprobs.detach()) * m).sum(-1) / tokens.clamp(min=1.0)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_seq = -torch.min(ratio * advantages, clipped * advantages)
    present = (tokens > 0).to(logprobs.dtype)  # a row without completion tokens adds nothing
    n = max(denom.sequences, 1.0)
    loss = (per_seq * present).sum() / n
    with torch.no_grad():
        out_of_range = ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)).to(logprobs.dtype)
        metrics = {
            "seq_ratio_mean": (ratio * present).sum() / n,
            "seq_clip_frac": (out_of_range * present).sum() / n,
        }
    return LossOutput(loss, metrics)
