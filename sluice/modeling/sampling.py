"""The sampling transform: logits to the log-probs of the distribution a rollout samples from.

One function serves both sides of the importance ratio: the hf engine samples from it and
reports its log-probs as the behaviour policy's, and the learner (`learner/batch.py`,
`token_logprobs`) recomputes the policy's log-probs with it. It lives here, beside the model
builder that both roles already import, so neither imports the other. docs/architecture.md
(Rollout service, "Sampling transform") states the choices below.

The order is vLLM 0.32's, read in `vllm/v1/sample/sampler.py` (`Sampler.sample`) and
`ops/topk_topp_sampler.py`: logits in float32, divided by the temperature; then the
argmax-invariant logits processors, of which min_p is the built-in one (`MinPLogitsProcessor`:
drop p < min_p * max p, p the softmax of the tempered logits); then top_k (drop logits below
the k-th largest, so ties with it stay) and top_p on what is left (sort ascending, softmax,
cumulative sum; drop where it is <= 1 - top_p, the most likely token always stays). Dropped
logits are -inf, and `processed_logprobs` is the log-softmax of those filtered logits: the
renormalised distribution over the kept set, the one sampled from.

`keep` forces tokens into the kept set. The learner passes its targets (the tokens the
rollout sampled): after updates, a sampled token may fall outside the *current* policy's
kept set, where its log-prob would be -inf, the importance weight 0 * inf and the loss NaN.
With the target kept, the recomputed log-prob is the token's log-prob in the filtered
distribution of the kept set plus that token: equal to the engine's number on-policy (the
token was in the kept set), finite and differentiable off-policy. The proximal policy of
decoupled PPO and the KL reference policy are computed the same way (filtered, target kept):
the ratio is between distributions of one family, the KL to the initial weights is 0 at the
start, and k3 = exp(ref - logp) - (ref - logp) - 1 never sees an infinite log-prob.

The filters are discontinuous: a token within float noise of a threshold (the k-th logit, the
top_p boundary) may be kept by the engine and dropped by the learner's recomputation, which
changes the normaliser by that token's probability. The tests measure how rarely that shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class SamplingKnobs(Protocol):
    """What the transform reads: `RolloutConfig` and the engines' `SamplingParams` have it."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...
    @property
    def min_p(self) -> float: ...


@dataclass(frozen=True)
class SamplingTransform:
    """temperature > 0; top_k 0 is off; top_p 1 is off; min_p 0 is off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @classmethod
    def of(cls, knobs: SamplingKnobs) -> SamplingTransform:
        return cls(knobs.temperature, knobs.top_k, knobs.top_p, knobs.min_p)

    @property
    def filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def sampling_logprobs(
    logits: torch.Tensor, transform: SamplingTransform, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """log-probs over the vocabulary (last dim) of the distribution sampled from: tempered,
    filtered (-inf outside the kept set), renormalised. `keep` (logits' shape without the
    vocabulary dim): one token id per row that stays in the kept set (the learner's targets)."""
    x = logits.float() / transform.temperature
    if not transform.filters:
        return torch.log_softmax(x, dim=-1)
    drop = dropped(x.detach(), transform)
    if keep is not None:
        drop.scatter_(-1, keep[..., None], False)
    return torch.log_softmax(x.masked_fill(drop, float("-inf")), dim=-1)


def dropped(x: torch.Tensor, t: SamplingTransform) -> torch.Tensor:
    """Where the filters drop a token of the tempered logits `x`, in vLLM's order (module doc):
    min_p, then top_k, then top_p on what is left."""
    drop = torch.zeros_like(x, dtype=torch.bool)
    if t.min_p > 0:
        p = x.softmax(-1)
        drop |= p < p.amax(-1, keepdim=True) * t.min_p
    if 0 < t.top_k < x.shape[-1]:
        kth = x.masked_fill(drop, float("-inf")).topk(t.top_k, dim=-1).values[..., -1:]
        drop |= x < kth
    if t.top_p < 1:
        ascending, order = x.masked_fill(drop, float("-inf")).sort(dim=-1)
        cumulative = ascending.softmax(-1).cumsum(-1)
        out = cumulative <= 1 - t.top_p
        out[..., -1] = False  # the most likely token always stays
        drop |= torch.zeros_like(drop).scatter_(-1, order, out)
    return drop
