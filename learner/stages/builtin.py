"""The built-in learner stages and the one function that builds a workflow's stages, built-in
or a user's by reference (the contract each declares is in sluice/config/workflow.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sluice.config.workflow import (
    BatchAdvantages,
    CriticValues,
    EntropyBonus,
    GaeAdvantages,
    GroupAdvantages,
    KLPenalty,
    MaskTruncated,
    PolicyLoss,
    ProximalLogprobs,
    ReferenceLogprobs,
    RlooAdvantages,
    UserStage,
    ValueLoss,
    contract,
)
from sluice.learner.losses.aggregate import Aggregation, aggregate
from sluice.learner.losses.base import LossOutput, TokenLossInputs
from sluice.learner.losses.grpo import group_advantages, group_mean
from sluice.learner.losses.kl import kl_penalty
from sluice.learner.losses.ppo import value_loss
from sluice.learner.losses.registry import TOKEN_LOSSES, TokenLoss, aggregation_of, token_loss
from sluice.learner.stages.advantages import (
    batch_whitened,
    masked_whitened,
    rloo_advantages,
    token_gae,
)
from sluice.learner.stages.base import Bound, Fields, LossContext, PrepareContext
from sluice.plugins import resolve_function


def proximal(fields: Fields, ctx: PrepareContext, _: ProximalLogprobs) -> Fields:
    return {"proximal_logprobs": ctx.logprobs(ctx.module)}


def reference(fields: Fields, ctx: PrepareContext, _: ReferenceLogprobs) -> Fields:
    assert ctx.reference is not None, "the objective loads the reference when a stage needs it"
    return {"ref_logprobs": ctx.logprobs(ctx.reference)}


def grouped(fields: Fields, ctx: PrepareContext, p: GroupAdvantages) -> Fields:
    r = fields["rewards"]
    adv = group_advantages(r.cpu(), fields["group_index"].cpu(), p.eps, p.normalize_std)
    return {"advantages": adv.to(r.device)}


def rloo(fields: Fields, ctx: PrepareContext, _: RlooAdvantages) -> Fields:
    return {"advantages": rloo_advantages(fields["rewards"], fields["group_index"])}


def batch_normalised(fields: Fields, ctx: PrepareContext, p: BatchAdvantages) -> Fields:
    r = fields["rewards"]
    if p.baseline == "group_mean":
        r = r - group_mean(r, fields["group_index"])[0]
    return {"advantages": batch_whitened(r, 0 if ctx.empty else len(r), ctx.dist, p.eps)}


@dataclass(frozen=True)
class PolicyBinding:
    """A policy_loss stage with its loss function and params, resolved once."""

    stage: PolicyLoss
    fn: TokenLoss
    params: Any


def mask_truncated(fields: Fields, ctx: PrepareContext, _: MaskTruncated) -> Fields:
    keep = ~fields["truncated"].bool()
    return {"mask": fields["mask"] & keep[:, None]}


def critic_values(fields: Fields, ctx: PrepareContext, _: CriticValues) -> Fields:
    assert ctx.critic is not None, "the objective builds the critic when a critic_values stage is present"
    return {"values": ctx.critic.values(ctx.batch) * fields["mask"]}


def gae(fields: Fields, ctx: PrepareContext, p: GaeAdvantages) -> Fields:
    mask = fields["mask"]
    adv, returns = token_gae(fields["rewards"], fields["values"], mask, p.gamma, p.lam)
    if p.whiten:
        adv = masked_whitened(adv, mask, ctx.dist, 1e-8)  # an empty rank's dummy mask is all 0
    return {"advantages": adv, "returns": returns}


def value_term(fields: Fields, ctx: LossContext, p: ValueLoss) -> LossOutput:
    assert ctx.critic is not None and ctx.batch is not None
    v = ctx.critic.values(ctx.batch)
    old = fields["values"] if p.clip is not None else None
    loss = value_loss(v, fields["returns"], fields["mask"], p.aggregation, ctx.denom, old, p.clip)
    return LossOutput(loss, {})


def policy_term(fields: Fields, ctx: LossContext, b: PolicyBinding) -> LossOutput:
    x = TokenLossInputs(
        fields["logprobs"],
        fields["behaviour_logprobs"],
        fields.get("proximal_logprobs"),
        fields["advantages"],
        fields["mask"],
        b.stage.aggregation,
        ctx.denom,
    )
    return b.fn(x, b.params)


def kl_term(fields: Fields, ctx: LossContext, p: KLPenalty) -> LossOutput:
    kl = kl_penalty(
        fields["logprobs"], fields["ref_logprobs"], fields["mask"], p.estimator, p.aggregation, ctx.denom
    )
    return LossOutput(kl, {})


def entropy_term(fields: Fields, ctx: LossContext, p: EntropyBonus) -> LossOutput:
    entropy = aggregate(fields["entropy"], fields["mask"], p.aggregation, ctx.denom)
    return LossOutput(-entropy, {"entropy": entropy.detach()})


BUILTIN: dict[type, Any] = {
    ProximalLogprobs: proximal,
    ReferenceLogprobs: reference,
    GroupAdvantages: grouped,
    RlooAdvantages: rloo,
    BatchAdvantages: batch_normalised,
    MaskTruncated: mask_truncated,
    CriticValues: critic_values,
    GaeAdvantages: gae,
    PolicyLoss: policy_term,
    KLPenalty: kl_term,
    EntropyBonus: entropy_term,
    ValueLoss: value_term,
}


def build_stages(stages: Sequence[Any]) -> tuple[list[Bound], list[Bound]]:
    """(prepare stages, loss stages) of `workflow.learner`, each bound to its params. A user's
    stage is resolved here (a one-line error naming its key when it does not resolve)."""
    prepare: list[Bound] = []
    loss: list[Bound] = []
    for i, st in enumerate(stages):
        if isinstance(st, UserStage):
            key = f"workflow.learner[{i}].stage"
            fn, params = resolve_function(
                st.stage, "stages", key, st.params, ("workflow", "learner", str(i), "params")
            )
            writes = tuple(st.writes) if st.phase == "prepare" else None
            bound = Bound(
                st.metric, _checked_loss(fn, st.metric) if st.phase == "loss" else fn, params, st.coef, writes
            )
        elif type(st) in BUILTIN:
            params = PolicyBinding(st, *token_loss(st.loss)) if isinstance(st, PolicyLoss) else st
            bound = Bound(st.metric or st.stage, BUILTIN[type(st)], params, getattr(st, "coef", 1.0))
        else:
            raise ValueError(f"workflow.learner[{i}]: {st.stage} is not an LLM learner stage")
        (loss if st.phase == "loss" else prepare).append(bound)
    return prepare, loss


def needs_reference(stages: Sequence[Any]) -> bool:
    return any(isinstance(s, ReferenceLogprobs) for s in stages)


def needs_entropy(stages: Sequence[Any]) -> bool:
    """A loss stage reads the sampling distribution's entropy (the loss forward then computes it)."""
    return any(st.phase == "loss" and "entropy" in contract(st)[0] for st in stages)


def zero_at_zero_advantage(stages: Sequence[Any]) -> list[Aggregation] | None:
    """Each loss stage's aggregation where every loss stage is a built-in policy loss (grpo, ppo,
    decoupled_ppo, gspo: a row's terms are the advantage times a function of its ratios, so a row
    whose advantage is 0 has exactly 0 gradient); None where a term has gradient there (a KL or
    entropy term, a value loss, a user's stage or loss)."""
    modes: list[Aggregation] = []
    for st in stages:
        if st.phase != "loss":
            continue
        # a user's loss has its reference as `type`, never a key of the built-in table
        if not isinstance(st, PolicyLoss) or st.loss.type not in TOKEN_LOSSES:
            return None
        modes.append(aggregation_of(st.loss.type, st.aggregation))
    return modes


def critic_config(stages: Sequence[Any]) -> CriticValues | None:
    return next((s for s in stages if isinstance(s, CriticValues)), None)


def _checked_loss(fn: Any, name: str) -> Any:
    def call(fields: Fields, ctx: LossContext, params: Any) -> LossOutput:
        out = fn(fields, ctx, params)
        if not isinstance(out, LossOutput) or not isinstance(out.loss, torch.Tensor):
            raise TypeError(f"stage {name!r} returned a {type(out).__name__}, not a LossOutput")
        return out

    return call
