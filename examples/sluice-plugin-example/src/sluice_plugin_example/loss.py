"""A custom token loss: REINFORCE on group advantages (no ratio, no clipping), scaled by
`scale`. The interface (inputs, params, output) is Sluice's: sluice/learner/losses/base.py.

It has no off-policy correction: under `learner.max_staleness` >= 1 it trains samples of older
weights as if they were current. On the quickstart (max_staleness 1) it learns, but one run of
the end-to-end test rose 0.08 -> 0.30 and then fell back to 0.20 as its completions grew
(tests/test_e2e_plugins.py); the built-in `grpo` loss weighs each token by min(pi/mu, is_cap)."""

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
