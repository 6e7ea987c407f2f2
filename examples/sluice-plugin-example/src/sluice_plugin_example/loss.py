"""A custom token loss: REINFORCE on group advantages (no ratio, no clipping), scaled by
`scale`. The interface (inputs, params, output) is Sluice's: sluice/learner/losses/base.py."""

from __future__ import annotations

from pydantic import Field

from sluice.config.base import Section
from sluice.learner.losses.base import LossOutput, TokenLossInputs


class ReinforceParams(Section):
    scale: float = Field(default=1.0, gt=0)
    """Multiplies the policy gradient."""


def reinforce(inputs: TokenLossInputs, params: ReinforceParams) -> LossOutput:
    """-A * log pi per token, reduced like every Sluice loss (inputs.aggregate)."""
    adv = inputs.advantages if inputs.advantages.dim() == 2 else inputs.advantages[:, None]
    loss = inputs.aggregate(-params.scale * adv * inputs.logprobs)
    return LossOutput(loss, {"logp_mean": inputs.aggregate(inputs.logprobs.detach())})


reinforce.Params = ReinforceParams  # type: ignore[attr-defined]
