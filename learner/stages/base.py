"""What a learner stage of a workflow is given and returns (docs/workflows.md, "Stages").

A batch is a dict of named tensors, its *fields*: per sequence `[B]` or per target position
`[B, T]` (T = L - 1, aligned with the batch's next-token targets). Micro-batching slices every
field by rows and trims `[B, T]` fields to the piece's width, so a stage never sees padding
columns that no row uses.

    behaviour_logprobs [B, T]  log mu of the sampled tokens (0 outside completions)
    mask               [B, T]  1 where a token is trained on
    rewards            [B]     the task's reward of each completion
    group_index        [B]     0..G-1, the completion's group (whole groups are on one rank)
    versions           [B]     policy version that sampled each completion
    truncated          [B]     bool: cut at the token budget (the rollout's info["truncated"])
    values, returns    [B, T]  with a critic (critic_values, gae_advantages)
    logprobs           [B, T]  loss phase only: log pi_theta of the targets, with gradient
    entropy            [B, T]  loss phase only, when a stage reads it: pi_theta's sampling entropy

A prepare stage runs once per batch without gradient and returns new fields; a loss stage runs
on every micro-batch and returns a `LossOutput` (learner/losses/base.py) whose loss is that
piece's share of the minibatch mean (`ctx.denom`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from sluice.learner.batch import TokenBatch, token_logprobs
from sluice.learner.critic import Critic
from sluice.learner.dist import DistContext
from sluice.learner.losses.aggregate import Denominator
from sluice.learner.losses.base import LossOutput
from sluice.modeling.sampling import SamplingTransform

Fields = dict[str, torch.Tensor]


@dataclass
class PrepareContext:
    """What a prepare stage may use besides the fields."""

    module: torch.nn.Module  # the policy, weights as before this batch's first update
    reference: torch.nn.Module | None  # the frozen initial weights, when a stage needs them
    batch: TokenBatch  # input ids and targets, for a forward
    sampling: SamplingTransform  # the rollouts' temperature and filters
    dist: DistContext  # for a statistic over the whole batch (all ranks)
    empty: bool  # this rank has no data: the fields are a zero-masked dummy row
    critic: Critic | None = None  # the value model, when the workflow has a critic_values stage

    def logprobs(self, model: torch.nn.Module) -> torch.Tensor:
        """log model(target) of every target position: [B, T]."""
        return token_logprobs(model, self.batch, self.sampling)


@dataclass
class LossContext:
    """What a loss stage may use besides the fields."""

    denom: Denominator  # token and sequence counts of the whole minibatch, all ranks
    batch: TokenBatch | None = None  # this piece's ids and masks, for a forward of another model
    critic: Critic | None = None  # the value model, when the workflow has one


class PrepareStage(Protocol):
    name: str

    def run(self, fields: Fields, ctx: PrepareContext) -> Fields: ...


class LossStage(Protocol):
    name: str  # the term is logged under it
    coef: float

    def run(self, fields: Fields, ctx: LossContext) -> LossOutput: ...


@dataclass
class Bound:
    """A stage function with its validated params: a built-in's config, or a user's Params."""

    name: str
    fn: Callable[[Fields, Any, Any], Any]
    params: Any
    coef: float = 1.0
    writes: tuple[str, ...] | None = None  # a user's prepare stage: exactly these come back

    def run(self, fields: Fields, ctx: Any) -> Any:
        out = self.fn(fields, ctx, self.params)
        if self.writes is not None:
            _check_writes(self.name, out, self.writes)
        return out


def _check_writes(name: str, out: Any, writes: tuple[str, ...]) -> None:
    if not isinstance(out, dict):
        raise TypeError(f"stage {name!r} returned a {type(out).__name__}, not a dict of fields")
    if set(out) != set(writes):
        raise TypeError(
            f"stage {name!r} returned fields {sorted(out)}; its workflow entry declares {list(writes)}"
        )
    bad = [k for k, v in out.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"stage {name!r}: fields {bad} are not tensors")
