"""The loss (`learner.loss`) and the settings of the two objectives around it (`learner.llm`,
`learner.classic`), each knob where the code that reads it is (docs/architecture.md, "Objectives
and losses").

`learner.loss` is a union tagged by `type`: a built-in name picks that loss's model, anything
else is a user's loss by reference (`CustomLoss`), so a knob of another loss is a config error
naming the key. Validation stays syntactic (no user code is imported: every role validates the
config); the learner resolves the reference when it builds its objective.

The union's tags are written `type=<name>`: the config loader reads a location part with `=` as
a tag and leaves it out of the key it prints (sluice/config/loader.py).
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, TypeAdapter, field_validator

from sluice.config.base import Section
from sluice.plugins import PluginRef, is_reference

BUILTIN_LOSSES = ("grpo", "ppo", "decoupled_ppo", "gspo", "vtrace")
Aggregation = Literal["token", "sequence"]
"""How a loss's terms become one number: a mean over the batch's tokens, or over its sequences."""
CUSTOM_TAG = "type=<reference>"


class GrpoLoss(Section):
    """GRPO: token-level policy gradient on group advantages, truncated IS against the
    behaviour policy (LLM only)."""

    type: Literal["grpo"] = "grpo"
    is_cap: float = Field(default=2.0, gt=0)
    """Truncated importance sampling: behaviour weights pi / mu are capped at this value."""


class PPOLoss(Section):
    """PPO: clipped surrogate against the behaviour policy."""

    type: Literal["ppo"] = "ppo"
    clip_low: float = Field(default=0.2, ge=0, lt=1)
    """Ratio clip below: 1 - clip_low."""
    clip_high: float = Field(default=0.2, ge=0)
    """Ratio clip above: 1 + clip_high. DAPO's clip-higher sets it above clip_low (0.28)."""


class DecoupledPPOLoss(Section):
    """Decoupled PPO (AReaL): clipped surrogate against the proximal policy, times the
    truncated behaviour weight pi_prox / mu."""

    type: Literal["decoupled_ppo"] = "decoupled_ppo"
    clip_low: float = Field(default=0.2, ge=0, lt=1)
    """Ratio clip below: 1 - clip_low (the ratio is pi / pi_prox)."""
    clip_high: float = Field(default=0.2, ge=0)
    """Ratio clip above: 1 + clip_high."""
    is_cap: float = Field(default=2.0, gt=0)
    """Behaviour weights pi_prox / mu are capped at this value."""
    recompute_proximal: bool = True
    """Compute the proximal policy's log-probs with the learner's weights before the batch's
    updates. False: the proximal policy is the behaviour policy (weights are 1)."""


class GspoLoss(Section):
    """GSPO (Zheng et al. 2025): PPO's clipped surrogate on the sequence-level ratio, the
    geometric mean over a completion's tokens of pi / pi_old (LLM only)."""

    type: Literal["gspo"] = "gspo"
    clip_low: float = Field(default=3e-4, ge=0, lt=1)
    """Sequence ratio clip below: 1 - clip_low (the paper's 3e-4)."""
    clip_high: float = Field(default=4e-4, ge=0)
    """Sequence ratio clip above: 1 + clip_high (the paper's 4e-4)."""
    recompute_proximal: bool = False
    """pi_old is the learner's weights before the batch's updates (needs a proximal_logprobs
    stage); False: the behaviour policy that sampled the completion."""


class VTraceLoss(Section):
    """V-trace: IMPALA actor-critic on whole segments (classic RL only)."""

    type: Literal["vtrace"] = "vtrace"
    rho_bar: float = Field(default=1.0, gt=0)
    """Cap of the importance weights in the value targets and the policy gradient."""
    c_bar: float = Field(default=1.0, gt=0)
    """Cap of the trace-cutting coefficients c."""
    trace_lambda: float = Field(default=1.0, ge=0, le=1)
    """Lambda multiplying the trace coefficients."""


class CustomLoss(Section):
    """A user's token loss (LLM only), `(inputs, params) -> LossOutput`
    (learner/losses/base.py)."""

    type: PluginRef
    """A name registered under the `sluice.losses` entry points, `package.module:fn` or
    `path/to/file.py:fn`."""
    params: dict[str, Any] = {}
    """The loss's settings, validated by its `Params` model when it has one."""
    recompute_proximal: bool = False
    """Compute the proximal policy's log-probs before the batch's updates and pass them as
    `inputs.proximal_logprobs` (None otherwise)."""

    @field_validator("type")
    @classmethod
    def _named(cls, ref: str) -> str:
        """Syntactic: a reference, or a registered name (read from package metadata, nothing
        imported). Whether a reference resolves is checked by the learner and the launcher."""
        if is_reference(ref) or ref in entry_points(group="sluice.losses").names:
            return ref
        builtins = ", ".join(repr(n) for n in BUILTIN_LOSSES)
        raise ValueError(
            f"not a built-in loss ({builtins}), a name registered under the sluice.losses entry "
            "points, or a reference `package.module:fn` / `path/to/file.py:fn`"
        )


def _loss_tag(value: Any) -> str:
    """The union member a `learner.loss` value is for: a built-in `type` picks its model
    (missing: grpo), anything else the custom loss."""
    kind = value.get("type", "grpo") if isinstance(value, dict) else getattr(value, "type", "grpo")
    return f"type={kind}" if kind in BUILTIN_LOSSES else CUSTOM_TAG


LossConfig = Annotated[
    Annotated[GrpoLoss, Tag("type=grpo")]
    | Annotated[PPOLoss, Tag("type=ppo")]
    | Annotated[DecoupledPPOLoss, Tag("type=decoupled_ppo")]
    | Annotated[GspoLoss, Tag("type=gspo")]
    | Annotated[VTraceLoss, Tag("type=vtrace")]
    | Annotated[CustomLoss, Tag(CUSTOM_TAG)],
    Discriminator(_loss_tag),
]
"""`learner.loss`: one of the built-in losses or a user's loss, by `type`."""

_LOSS_ADAPTER: TypeAdapter[LossConfig] = TypeAdapter(LossConfig)


def parse_loss(data: dict[str, Any]) -> LossConfig:
    """A `learner.loss` from a mapping (`{"type": "ppo", "clip_high": 0.28}`)."""
    return _LOSS_ADAPTER.validate_python(data)


def needs_proximal(loss: LossConfig) -> bool:
    """Whether the objective computes the proximal policy's log-probs before the updates."""
    return isinstance(loss, DecoupledPPOLoss | GspoLoss | CustomLoss) and loss.recompute_proximal


class LLMObjectiveConfig(Section):
    """The LLM (token) objective around any loss: advantages, aggregation, KL (rollout.kind llm)."""

    aggregation: Aggregation = "token"
    """token: mean over all tokens of the batch (DAPO's token-level loss); sequence: mean over
    sequences of each sequence's token mean (the original GRPO). Used by the loss and the KL."""
    adv_eps: float = Field(default=1e-4, gt=0)
    """Added to the group reward std before dividing (group advantages)."""
    normalize_std: bool = True
    """Divide group-centred rewards by the group std (GRPO); False gives Dr.GRPO-style advantages."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the KL penalty to the reference model (the initial weights); 0: off."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """KL estimator per token: k1 = log pi - log ref; k3 = ref/pi - log(ref/pi) - 1 (>= 0)."""


class ClassicObjectiveConfig(Section):
    """The classic-RL objective: discount, value head, entropy, GAE (rollout.kind env)."""

    gamma: float = Field(default=1.0, ge=0, le=1)
    """Discount (GAE and V-trace)."""
    value_coef: float = Field(default=0.5, ge=0)
    """Weight of the value loss."""
    entropy_coef: float = Field(default=0.0, ge=0)
    """Weight of the entropy bonus."""
    gae_lambda: float = Field(default=0.95, ge=0, le=1)
    """GAE lambda (ppo, decoupled_ppo)."""
    value_clip: float | None = Field(default=None, gt=0)
    """PPO value clipping around the proximal values; None: no clipping (ppo, decoupled_ppo)."""
    normalize_advantages: bool = False
    """Whiten advantages over the whole learner batch (all ranks) before the updates (ppo,
    decoupled_ppo)."""


PPO_ONLY = ("gae_lambda", "value_clip", "normalize_advantages")


def changed(section: Section) -> list[str]:
    """The fields of `section` that differ from their defaults (a full dump of a config sets
    every key, so "set" cannot mean "given")."""
    return [k for k, f in type(section).model_fields.items() if getattr(section, k) != f.default]


def check_objective(
    kind: str, loss: LossConfig, llm: LLMObjectiveConfig, classic: ClassicObjectiveConfig
) -> None:
    """Raise ValueError when the loss or a setting is for the other objective (`kind` is
    rollout.kind): such a knob would be silently ignored."""
    if kind == "llm":
        if isinstance(loss, VTraceLoss):
            raise ValueError("learner.loss.type=vtrace is for classic RL: it needs rollout.kind=env")
        problems = [f"learner.classic.{k}: a classic-RL setting (rollout.kind=env)" for k in changed(classic)]
    elif isinstance(loss, GrpoLoss | GspoLoss | CustomLoss):
        what = (
            f"{loss.type} is" if isinstance(loss, GrpoLoss | GspoLoss) else f"{loss.type!r} is a custom loss,"
        )
        raise ValueError(
            f"learner.loss.type: {what} for LLM tokens (rollout.kind=llm); classic RL "
            "(rollout.kind=env) takes ppo, decoupled_ppo or vtrace"
        )
    else:
        problems = [f"learner.llm.{k}: an LLM setting (rollout.kind=llm)" for k in changed(llm)]
        if isinstance(loss, VTraceLoss):
            problems += [
                f"learner.classic.{k}: not read by learner.loss.type=vtrace (ppo, decoupled_ppo)"
                for k in changed(classic)
                if k in PPO_ONLY
            ]
    if problems:
        raise ValueError(f"{'; '.join(problems)}; this run has rollout.kind={kind}")
