"""KL penalty to a reference policy (the initial weights), per token.

k1 = log pi - log ref: unbiased for KL(pi || ref) but noisy and can be negative per token.
k3 = ref/pi - log(ref/pi) - 1: unbiased, low variance and never negative (Schulman 2020;
the estimator GRPO uses).
"""

from __future__ import annotations

from typing import Literal

import torch

from sluice.learner.losses.aggregate import Aggregation, Denominator, aggregate


def kl_per_token(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: Literal["k1", "k3"]
) -> torch.Tensor:
    if estimator == "k1":
        return logprobs - ref_logprobs
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    estimator: Literal["k1", "k3"],
    mode: Aggregation,
    denom: Denominator,
) -> torch.Tensor:
    return aggregate(kl_per_token(logprobs, ref_logprobs, estimator), mask, mode, denom)
