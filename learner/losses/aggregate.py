"""How per-token (or per-step) loss terms become one number.

A learner step may be split over ranks and micro-batches, so a mean must divide by the count
of the *whole* batch, not of the piece at hand: `Denominator` carries the global counts, and
summing `aggregate(...)` over every piece gives exactly the mean over the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.config.loss import Aggregation


@dataclass(frozen=True)
class Denominator:
    tokens: float  # masked tokens (steps) in the whole minibatch, over all ranks
    sequences: float  # sequences (trajectories) in the whole minibatch, over all ranks
    # Where rows without gradient were left out of the step (`learner.skip_zero_advantage`),
    # `tokens` and `sequences` count the rows kept and these the whole minibatch's.
    whole_tokens: float | None = None
    whole_sequences: float | None = None

    def share(self, mode: Aggregation) -> float:
        """What a mean over the rows kept weighs in the mean over the whole minibatch: a loss
        stage's term times this is its term over the whole minibatch (the rows left out add 0)."""
        kept, whole = (
            (self.tokens, self.whole_tokens) if mode == "token" else (self.sequences, self.whole_sequences)
        )
        return 1.0 if whole is None else kept / max(whole, 1.0)

    @staticmethod
    def of(mask: torch.Tensor) -> Denominator:
        """The counts of one local batch (single process, no accumulation)."""
        return Denominator(float(mask.sum()), float(mask.shape[0]))


def aggregate(
    values: torch.Tensor, mask: torch.Tensor, mode: Aggregation, denom: Denominator
) -> torch.Tensor:
    """values, mask: [B, T]. token: sum(values * mask) / tokens (DAPO's token-level mean: long
    sequences weigh more). sequence: sum over sequences of their token mean / sequences (GRPO:
    every sequence weighs the same)."""
    mask = mask.to(values.dtype)
    if mode == "token":
        return (values * mask).sum() / max(denom.tokens, 1.0)
    per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_seq.sum() / max(denom.sequences, 1.0)


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask.to(values.dtype)).sum()


def categorical_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension."""
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)
