"""The table of token losses: `learner.loss.type` -> the function the objective calls, built-in
or a user's by reference (docs/architecture.md, "Objectives and losses"; the interface, inputs
and output, is in learner/losses/base.py).

Each built-in entry adapts a loss module's tensor function (grpo.py, ppo.py, decoupled.py,
gspo.py) to the one interface and takes its own config model as params. The classic-RL objective uses the
ppo and decoupled_ppo entries too, with its steps as the tokens of one row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sluice.config.errors import ConfigError
from sluice.config.loss import (
    Aggregation,
    CustomLoss,
    DecoupledPPOLoss,
    GrpoLoss,
    GspoLoss,
    LossConfig,
    PPOLoss,
)
from sluice.learner.losses.base import LossOutput, TokenLossInputs
from sluice.learner.losses.decoupled import decoupled_ppo_loss
from sluice.learner.losses.grpo import grpo_loss
from sluice.learner.losses.gspo import gspo_loss
from sluice.learner.losses.plugin import KEY, load_custom_loss
from sluice.learner.losses.ppo import clipped_surrogate

TokenLoss = Callable[[TokenLossInputs, Any], LossOutput]


def grpo(x: TokenLossInputs, p: GrpoLoss) -> LossOutput:
    return grpo_loss(x.logprobs, x.behaviour_logprobs, x.advantages, x.mask, p.is_cap, x.aggregation, x.denom)


def ppo(x: TokenLossInputs, p: PPOLoss) -> LossOutput:
    return clipped_surrogate(
        x.logprobs,
        x.behaviour_logprobs,
        x.advantages,
        x.mask,
        p.clip_low,
        p.clip_high,
        x.aggregation,
        x.denom,
    )


def decoupled_ppo(x: TokenLossInputs, p: DecoupledPPOLoss) -> LossOutput:
    """Without proximal log-probs (`recompute_proximal: false`) the proximal policy is mu."""
    proximal = x.proximal_logprobs if x.proximal_logprobs is not None else x.behaviour_logprobs
    return decoupled_ppo_loss(
        x.logprobs,
        proximal,
        x.behaviour_logprobs,
        x.advantages,
        x.mask,
        p.clip_low,
        p.clip_high,
        p.is_cap,
        x.aggregation,
        x.denom,
    )


def gspo(x: TokenLossInputs, p: GspoLoss) -> LossOutput:
    """Sequence-level by definition (SEQUENCE_LOSSES): `aggregation` does not apply. pi_old is the proximal
    policy when the workflow computes it (`recompute_proximal`), else mu."""
    old = x.proximal_logprobs if p.recompute_proximal else x.behaviour_logprobs
    assert old is not None, "gspo with recompute_proximal needs a proximal_logprobs stage"
    return gspo_loss(x.logprobs, old, x.advantages, x.mask, p.clip_low, p.clip_high, x.denom)


TOKEN_LOSSES: dict[str, TokenLoss] = {
    "grpo": grpo,
    "ppo": ppo,
    "decoupled_ppo": decoupled_ppo,
    "gspo": gspo,
}
SEQUENCE_LOSSES = frozenset({"gspo"})
"""Built-ins whose terms are means over sequences whatever the stage's `aggregation` says."""


def aggregation_of(loss_type: str, aggregation: Aggregation) -> Aggregation:
    """How a built-in loss's terms share the minibatch: by sequences for SEQUENCE_LOSSES, else as
    the stage aggregates."""
    return "sequence" if loss_type in SEQUENCE_LOSSES else aggregation


def token_loss(cfg: LossConfig) -> tuple[TokenLoss, Any]:
    """(the function, its params) for `learner.loss`: a built-in of the table with its config
    model, or the user's loss with its validated params."""
    if isinstance(cfg, CustomLoss):
        fn, params = load_custom_loss(cfg)
        return _checked(fn, cfg.type), params
    if cfg.type not in TOKEN_LOSSES:
        raise ConfigError(f"config error: {KEY}: {cfg.type!r} is not a token loss ({sorted(TOKEN_LOSSES)})")
    return TOKEN_LOSSES[cfg.type], cfg


def _checked(fn: Callable[..., Any], ref: str) -> TokenLoss:
    """`fn`, failing with its name when it returns something other than a LossOutput."""

    def call(inputs: TokenLossInputs, params: Any) -> LossOutput:
        out = fn(inputs, params)
        if not isinstance(out, LossOutput):
            raise TypeError(f"{KEY} {ref!r} returned a {type(out).__name__}, not a LossOutput")
        return out

    return call
