"""What every loss receives and returns, built-in and custom alike (docs/architecture.md,
"Objectives and losses").

A loss is a callable `loss(inputs: TokenLossInputs, params) -> LossOutput`. The token (LLM)
objective calls the loss that `learner.loss.type` names through one table
(learner/losses/registry.py); a user's loss is named by reference (`package.module:fn`,
`path/to/file.py:fn`, or an entry point of the `sluice.losses` group) and gets
`learner.loss.params`: validated by its `Params` attribute (a pydantic model, best a
`sluice.config.base.Section` so a typo is an error) when it has one, else as a plain dict.

    class Params(Section):
        scale: float = 1.0

    def reinforce(inputs: TokenLossInputs, params: Params) -> LossOutput:
        loss = inputs.aggregate(-params.scale * inputs.advantages[:, None] * inputs.logprobs)
        return LossOutput(loss, {})

    reinforce.Params = Params

Rules a loss keeps, because a step is split over ranks and micro-batches:
- reduce with `inputs.aggregate` (or `aggregate` with `inputs.denom`), so the sum over pieces is
  the mean over the whole minibatch;
- metrics are detached 0-d tensors, each a share of a global mean (divide by `inputs.denom`):
  the trainer sums them over micro-batches and ranks and averages over updates, except
  `is_weight_max`, reduced with max;
- be finite when `mask` is all zero: a rank without data computes a dummy piece (its loss is
  multiplied by 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sluice.learner.losses.aggregate import Aggregation, Denominator, aggregate


@dataclass(frozen=True)
class TokenLossInputs:
    """One piece of a minibatch: B sequences of T target positions."""

    logprobs: torch.Tensor  # [B, T] log pi_theta of the sampled tokens, with gradient
    behaviour_logprobs: torch.Tensor  # [B, T] log mu: the policy that sampled them (rollout)
    proximal_logprobs: torch.Tensor | None  # [B, T] the learner's before this batch's updates, if asked
    advantages: torch.Tensor  # [B] one per sequence (group advantages); [B, T] in classic PPO
    mask: torch.Tensor  # [B, T] 1 where a token is trained on (completion, not prompt or padding)
    aggregation: Aggregation  # learner.llm.aggregation
    denom: Denominator  # token and sequence counts of the whole minibatch, all ranks

    def aggregate(self, values: torch.Tensor) -> torch.Tensor:
        """values [B, T] reduced to this piece's share of the minibatch mean."""
        return aggregate(values, self.mask, self.aggregation, self.denom)


@dataclass
class LossOutput:
    loss: torch.Tensor  # 0-d, with gradient
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # detached 0-d, shares of means
