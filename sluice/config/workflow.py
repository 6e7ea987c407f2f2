"""Algorithms as data: the stages of a run's per-batch processing, declared in YAML and checked
when the config loads (docs/workflows.md).

A workflow lists, in order, the rollout's group filters and the learner's stages (log-probs,
advantages, loss terms). Each stage declares the trajectory fields it reads and writes, and
`check_workflow` refuses a stage that reads a field no earlier stage writes, naming both. The
staleness bound, leases and acks are not stages: no workflow can reach them.

`workflow:` in a run config is a shipped name (`grpo`: configs/algorithms/grpo.yaml), a YAML
file's path or the mapping itself; without it, `effective_workflow` builds the equivalent
workflow from `learner.loss`, `learner.llm`, `learner.classic` and
`rollout.drop_zero_variance_groups`, so the learner and the rollout read one thing.

Torch-free, like every config module: every role validates the config. The learner's
implementations of the stages are in learner/stages/.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, Tag, field_validator

from sluice.config.base import Section
from sluice.config.loss import (
    Aggregation,
    ClassicObjectiveConfig,
    GrpoLoss,
    LossConfig,
    PPOLoss,
    needs_proximal,
)
from sluice.plugins import PluginRef, is_reference

Phase = Literal["prepare", "loss"]

LLM_BATCH_FIELDS = ("behaviour_logprobs", "mask", "rewards", "group_index", "versions", "truncated")
"""What an LLM learner batch starts with (shapes in learner/stages/base.py)."""
ENV_BATCH_FIELDS = ("obs", "actions", "behaviour_logprobs", "rewards", "terminated", "ended")
"""What a classic-RL learner batch starts with (whole segments)."""
LOSS_PHASE_FIELDS = ("logprobs", "entropy")
"""Added for loss stages, with gradient: the policy's log-probs of the targets, and the entropy
of its sampling distribution at each position (computed only when a stage reads it)."""
ALGORITHMS_DIR = Path(__file__).resolve().parent.parent / "algorithms"
"""The shipped workflows: sluice/algorithms is a link to configs/algorithms."""


class _Stage(Section):
    phase: ClassVar[Phase] = "prepare"
    metric: ClassVar[str] = ""  # a loss stage's term is logged under this name
    # The fields it reads and writes; a stage whose settings change them overrides reads()/writes().
    READS: ClassVar[tuple[str, ...]] = ()
    WRITES: ClassVar[tuple[str, ...]] = ()

    def reads(self) -> tuple[str, ...]:
        return self.READS

    def writes(self) -> tuple[str, ...]:
        return self.WRITES


class ProximalLogprobs(_Stage):
    """log pi_prox of the targets: the learner's weights before this batch's first update."""

    stage: Literal["proximal_logprobs"] = "proximal_logprobs"

    WRITES = ("proximal_logprobs",)


class ReferenceLogprobs(_Stage):
    """log pi_ref of the targets under the run's initial weights, kept frozen on every rank."""

    stage: Literal["reference_logprobs"] = "reference_logprobs"

    WRITES = ("ref_logprobs",)


class GroupAdvantages(_Stage):
    """GRPO: (r - group mean) / (group std + eps); Dr.GRPO without the std."""

    stage: Literal["group_advantages"] = "group_advantages"
    normalize_std: bool = True
    """Divide by the group's reward std (GRPO); false: centred rewards only (Dr.GRPO)."""
    eps: float = Field(default=1e-4, gt=0)
    """Added to the std before dividing."""

    READS = ("rewards", "group_index")

    WRITES = ("advantages",)


class RlooAdvantages(_Stage):
    """RLOO: each sample's reward minus the mean reward of the other samples of its group."""

    stage: Literal["rloo_advantages"] = "rloo_advantages"

    READS = ("rewards", "group_index")

    WRITES = ("advantages",)


class BatchAdvantages(_Stage):
    """REINFORCE++: rewards (less the group mean with `baseline: group_mean`) whitened over the
    whole learner batch, every rank's samples."""

    stage: Literal["batch_advantages"] = "batch_advantages"
    baseline: Literal["none", "group_mean"] = "none"
    """Subtract each group's mean reward first (REINFORCE++-baseline)."""
    eps: float = Field(default=1e-8, gt=0)
    """Added to the batch std before dividing."""

    def reads(self) -> tuple[str, ...]:
        return ("rewards", "group_index") if self.baseline == "group_mean" else ("rewards",)

    WRITES = ("advantages",)


class MaskTruncated(_Stage):
    """DAPO's overlong filtering: a completion cut at the token budget is not trained on (its
    tokens leave the mask; its group's advantages are computed as before)."""

    stage: Literal["mask_truncated"] = "mask_truncated"

    READS = ("mask", "truncated")

    WRITES = ("mask",)


class CriticValues(_Stage):
    """V of every target position under the critic, before the updates: a value model the
    learner group trains beside the policy (learner/critic.py), initialised from the run's
    initial policy with a zero head."""

    stage: Literal["critic_values"] = "critic_values"
    lr: float = Field(default=1e-4, gt=0)
    """The critic's AdamW learning rate (constant)."""

    WRITES = ("values",)


class GaeAdvantages(_Stage):
    """Token-level GAE(gamma, lambda) over each completion's trained tokens, the task's reward
    on its last token; returns = advantages + values."""

    stage: Literal["gae_advantages"] = "gae_advantages"
    gamma: float = Field(default=1.0, ge=0, le=1)
    """Discount per token."""
    lam: float = Field(default=0.95, ge=0, le=1)
    """GAE lambda."""
    whiten: bool = True
    """Whiten the advantages over the batch's trained tokens (all ranks)."""

    READS = ("rewards", "values", "mask")

    WRITES = ("advantages", "returns")


class PolicyLoss(_Stage):
    """The policy-gradient term: any token loss of `learner.loss`'s table, or a user's."""

    phase: ClassVar[Phase] = "loss"
    metric: ClassVar[str] = "policy_loss"
    stage: Literal["policy_loss"] = "policy_loss"
    loss: LossConfig = GrpoLoss()
    """The loss, by `type` (sluice/config/loss.py): grpo, ppo, decoupled_ppo, gspo, or a reference."""
    aggregation: Aggregation = "token"
    """token: mean over the batch's tokens; sequence: mean over sequences of their token means."""

    def reads(self) -> tuple[str, ...]:
        base = ("logprobs", "behaviour_logprobs", "advantages", "mask")
        return (*base, "proximal_logprobs") if needs_proximal(self.loss) else base


class KLPenalty(_Stage):
    """coef x KL(pi || pi_ref) per token, aggregated like the policy loss."""

    phase: ClassVar[Phase] = "loss"
    metric: ClassVar[str] = "kl_ref"
    stage: Literal["kl_penalty"] = "kl_penalty"
    coef: float = Field(default=1e-3, gt=0)
    """Weight of the term."""
    estimator: Literal["k1", "k3"] = "k3"
    """k1 = log pi - log ref; k3 = ref/pi - log(ref/pi) - 1 (>= 0)."""
    aggregation: Aggregation = "token"
    """As the policy loss's."""

    READS = ("logprobs", "ref_logprobs", "mask")


class EntropyBonus(_Stage):
    """-coef x the entropy of the policy's sampling distribution per token (aggregated like the
    policy loss): keeps a group's samples different, so its advantages stay non-zero, against
    the collapse of exploration that stalls GRPO on small models (DAPO, Yu et al. 2025, 3.1)."""

    phase: ClassVar[Phase] = "loss"
    metric: ClassVar[str] = "entropy_bonus"  # (its value is -entropy; `entropy` is logged too)
    stage: Literal["entropy_bonus"] = "entropy_bonus"
    coef: float = Field(default=1e-3, gt=0)
    """Weight of the term (its loss is -entropy: larger keeps the policy more random)."""
    aggregation: Aggregation = "token"
    """As the policy loss's."""

    READS = ("entropy", "mask")


class ValueLoss(_Stage):
    """0.5 (V - returns)^2 per trained token under the critic, optionally clipped around the
    values of the prepare phase (PPO's value clipping)."""

    phase: ClassVar[Phase] = "loss"
    metric: ClassVar[str] = "value_loss"
    stage: Literal["value_loss"] = "value_loss"
    coef: float = Field(default=0.5, gt=0)
    """Weight of the term."""
    clip: float | None = Field(default=None, gt=0)
    """Clip V to values +- clip; None: no clipping."""
    aggregation: Aggregation = "token"
    """As the policy loss's."""

    READS = ("returns", "values", "mask")


class ActorCritic(_Stage):
    """Classic RL's whole objective: GAE or V-trace targets from a value head, the loss, the
    value loss and the entropy bonus (learner/objectives/env.py)."""

    phase: ClassVar[Phase] = "loss"
    metric: ClassVar[str] = "policy_loss"
    stage: Literal["actor_critic"] = "actor_critic"
    loss: LossConfig = PPOLoss()
    """ppo, decoupled_ppo or vtrace."""
    classic: ClassicObjectiveConfig = ClassicObjectiveConfig()
    """Discount, value and entropy weights, GAE (sluice/config/loss.py)."""

    def reads(self) -> tuple[str, ...]:
        return ENV_BATCH_FIELDS


class UserStage(Section):
    """A user's stage by reference; its contract is declared here, where the workflow is."""

    stage: PluginRef
    """A name under the `sluice.stages` entry points, `package.module:fn` or `path/file.py:fn`."""
    phase: Phase
    """prepare: `fn(fields, ctx, params) -> {field: tensor}`, no gradient, once per batch;
    loss: `fn(fields, ctx, params) -> LossOutput`, a term added to the loss (docs/workflows.md)."""
    reads: list[str] = []
    """Fields the function reads."""
    writes: list[str] = []
    """Fields a prepare function returns (exactly these)."""
    params: dict[str, Any] = {}
    """Its settings, validated by the function's `Params` model when it has one."""
    coef: float = 1.0
    """A loss stage's term is multiplied by this."""

    _named = field_validator("stage")(classmethod(lambda cls, ref: _user_ref(ref, LEARNER_STAGES)))

    @property
    def metric(self) -> str:
        return self.stage.rsplit(":", 1)[-1]

    def contract(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return tuple(self.reads), tuple(self.writes)


class DropZeroVariance(Section):
    """DAPO's dynamic sampling: a group whose rewards are all equal has zero advantages under
    group normalisation; it is dropped at the rollout (its quota given back)."""

    stage: Literal["drop_zero_variance"] = "drop_zero_variance"
    min_spread: float = Field(default=1e-9, ge=0)
    """A group is kept when max(reward) - min(reward) exceeds this."""
    keep_after: int | None = Field(default=256, ge=1)
    """After this many groups in a row dropped by one service, the next is kept anyway: once a
    task is solved (or gives no signal) every group scores the same, and dropping them all would
    starve the learner for good. A kept group's advantages are zero (the step learns nothing from
    it) and the service logs it. null: drop every one."""
    oversample: float = Field(default=2.0, ge=1.0)
    """At most this many times the granted prompts in one generate call. A service generates
    the grant over the share of groups it has been keeping (plus one), so that one call usually
    fills the grant instead of leaving a few groups to a second whole decode loop; kept groups
    beyond the grant are discarded (`surplus_groups`). 1: generate the grant, refill in rounds."""


class UserGroupFilter(Section):
    """A user's group filter: `fn(samples, params) -> bool`, True keeps the group."""

    stage: PluginRef
    """A name under the `sluice.stages` entry points, `package.module:fn` or `path/file.py:fn`."""
    params: dict[str, Any] = {}
    """Its settings, validated by the function's `Params` model when it has one."""

    _named = field_validator("stage")(classmethod(lambda cls, ref: _user_ref(ref, ROLLOUT_STAGES)))


def _user_ref(ref: str, builtins: dict[str, Any]) -> str:
    """Syntactic: a reference or a registered name (nothing imported; the pre-flight and the
    role that runs the stage resolve it)."""
    if is_reference(ref) or ref in entry_points(group="sluice.stages").names:
        return ref
    raise ValueError(
        f"not a built-in stage ({', '.join(builtins)}), a name registered under the sluice.stages "
        "entry points, or a reference `package.module:fn` / `path/to/file.py:fn`"
    )


LEARNER_STAGES = {
    c.model_fields["stage"].default: c
    for c in (
        ProximalLogprobs,
        ReferenceLogprobs,
        GroupAdvantages,
        RlooAdvantages,
        BatchAdvantages,
        MaskTruncated,
        CriticValues,
        GaeAdvantages,
        PolicyLoss,
        KLPenalty,
        EntropyBonus,
        ValueLoss,
        ActorCritic,
    )
}
ROLLOUT_STAGES = {"drop_zero_variance": DropZeroVariance}
USER_TAG = "stage=<reference>"


def _stage_tag(value: Any) -> str:
    kind = value.get("stage") if isinstance(value, dict) else getattr(value, "stage", None)
    return f"stage={kind}" if kind in LEARNER_STAGES or kind in ROLLOUT_STAGES else USER_TAG


LearnerStage = Annotated[
    Annotated[ProximalLogprobs, Tag("stage=proximal_logprobs")]
    | Annotated[ReferenceLogprobs, Tag("stage=reference_logprobs")]
    | Annotated[GroupAdvantages, Tag("stage=group_advantages")]
    | Annotated[RlooAdvantages, Tag("stage=rloo_advantages")]
    | Annotated[BatchAdvantages, Tag("stage=batch_advantages")]
    | Annotated[MaskTruncated, Tag("stage=mask_truncated")]
    | Annotated[CriticValues, Tag("stage=critic_values")]
    | Annotated[GaeAdvantages, Tag("stage=gae_advantages")]
    | Annotated[PolicyLoss, Tag("stage=policy_loss")]
    | Annotated[KLPenalty, Tag("stage=kl_penalty")]
    | Annotated[EntropyBonus, Tag("stage=entropy_bonus")]
    | Annotated[ValueLoss, Tag("stage=value_loss")]
    | Annotated[ActorCritic, Tag("stage=actor_critic")]
    | Annotated[UserStage, Tag(USER_TAG)],
    Discriminator(_stage_tag),
]
RolloutStage = Annotated[
    Annotated[DropZeroVariance, Tag("stage=drop_zero_variance")] | Annotated[UserGroupFilter, Tag(USER_TAG)],
    Discriminator(_stage_tag),
]


class WorkflowConfig(Section):
    """`workflow`: an algorithm as data (docs/workflows.md)."""

    name: str = "custom"
    """The algorithm's name (logged with the run)."""
    description: str = ""
    """What it is, for a reader of the file."""
    rollout: list[RolloutStage] = []
    """Group filters the rollout services apply after scoring, in order."""
    learner: list[LearnerStage] = Field(min_length=1)
    """The learner's stages, in order: prepare stages (no gradient), then loss stages."""


def contract(stage: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(reads, writes) of a learner stage, built-in or a user's."""
    if isinstance(stage, UserStage):
        return stage.contract()
    return stage.reads(), stage.writes()
