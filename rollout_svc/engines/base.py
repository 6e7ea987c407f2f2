"""The generation-engine interface every engine (hf, vllm, sim) implements.

Engines generate in *rounds*: a round prefills a set of sequences (prompt + what each already
generated) and decodes them until they end or new weights arrive. Between decode steps an
engine asks `interrupt()` for new weights; when some arrive the round stops, the engine loads
them in place, and the next round goes on from the same sequences:

- `continue` (partial rollout): every in-flight sequence keeps its tokens and goes on under the
  new weights. Its KV cache is rebuilt under the new weights (the next round prefills prompt +
  tokens), so every behaviour log-prob is exactly the new policy's. Each token records the
  version that sampled it; a trajectory's version is its oldest token's.
- `abort`: in-flight sequences drop their tokens and start again from the prompt under the new
  weights (requeued within the same call); the dropped tokens are counted as wasted work.
- `finish`: no interruption; weights change only between calls (every token of a call has one
  version).

The bookkeeping of sequences, versions and rounds is here, once; an engine implements only
`_decode_round` and `load_weights`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

InterruptMode = Literal["finish", "continue", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """One generation call's knobs (`rollout.*`). temperature, top_k, top_p, min_p make the
    sampling transform (sluice/modeling/sampling.py); a completion ends at end-of-sequence, at
    a token of `stop_token_ids`, or at the token whose decoded text completes a `stop` string
    (`completes_stop`); the ending token stays in the completion."""

    max_new_tokens: int
    temperature: float = 1.0
    on_new_weights: InterruptMode = "finish"  # what in-flight sequences do when weights arrive
    top_p: float = 1.0  # 1: off
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class WeightUpdate:
    """New weights for an engine: named tensors (empty for the sim engine) and their version."""

    version: int
    tensors: Sequence[tuple[str, Any]]


# Called by an engine between decode steps; returns new weights or None. Only consulted when
# SamplingParams.on_new_weights is "continue" or "abort".
InterruptPoll = Callable[[], WeightUpdate | None]


@dataclass
class Completion:
    token_ids: np.ndarray  # int32 [T], includes the end-of-sequence token when one was sampled
    logprobs: np.ndarray  # float32 [T], log-prob of each token under the tempered behaviour policy
    versions: np.ndarray  # int32 [T], policy version that sampled each token
    finished: bool  # True if it ended (end-of-sequence, stop token, stop string), False if cut at its budget
    discarded_tokens: int = 0  # tokens sampled and thrown away by `abort` restarts


class TokenCodec(Protocol):
    """What the rollout service needs from a tokenizer (HF tokenizers satisfy it). The ids are
    read-only here, so plain attributes (the sim engine's WordTokenizer) satisfy it too."""

    @property
    def bos_token_id(self) -> int: ...
    @property
    def eos_token_id(self) -> int: ...
    @property
    def unk_token_id(self) -> int | None: ...
    @property
    def pad_token_id(self) -> int | None: ...

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], *, skip_special_tokens: bool = ...) -> str: ...


@dataclass
class SequenceState:
    """One sequence being generated: its prompt, what it has sampled so far, and its budget."""

    prompt: list[int]
    budget: int  # most tokens it may sample
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False  # sampled end-of-sequence, a stop token, or completed a stop string
    discarded: int = 0

    @property
    def remaining(self) -> int:
        return self.budget - len(self.tokens)

    @property
    def active(self) -> bool:
        return not self.finished and self.remaining > 0

    @property
    def prefix(self) -> list[int]:
        """What the next round prefills: the prompt and every token sampled so far."""
        return self.prompt + self.tokens

    def append(self, token: int, logprob: float, version: int, ends: bool) -> None:
        """Add a sampled token; `ends`: it ends the sequence (the engine's stop rule)."""
        self.tokens.append(int(token))
        self.logprobs.append(float(logprob))
        self.versions.append(int(version))
        if ends:
            self.finished = True

    def restart(self) -> None:
        self.discarded += len(self.tokens)
        self.tokens, self.logprobs, self.versions = [], [], []

    def completion(self) -> Completion:
        return Completion(
            token_ids=np.asarray(self.tokens, dtype=np.int32),
            logprobs=np.asarray(self.logprobs, dtype=np.float32),
            versions=np.asarray(self.versions, dtype=np.int32),
            finished=self.finished,
            discarded_tokens=self.discarded,
        )


def completes_stop(codec: TokenCodec, tokens: Sequence[int], stops: Sequence[str]) -> bool:
    """Whether the last of `tokens` (a completion) completes a stop string in the completion's
    decoded text (skip_special_tokens, as the service decodes it for the reward). Cheap: only
    the tail is decoded, enough tokens for the longest stop string (every token but special
    ones decodes to at least one character) plus one whose start may decode differently
    alone (a leading space). Only a match that ends in the last token's text counts, as in
    vLLM's detokenizer: an earlier one would have ended the sequence already."""
    if not stops or not tokens:
        return False
    tail = list(tokens[-(max(len(s) for s in stops) + 2) :])
    text = codec.decode(tail, skip_special_tokens=True)
    before = len(codec.decode(tail[:-1], skip_special_tokens=True))
    return any(stop in text[max(before - len(stop) + 1, 0) :] for stop in stops)


class Engine(ABC):
    """Generates completions with per-token log-probs and takes new weights in place."""

    version: int  # policy version of the weights currently loaded
    tokenizer: TokenCodec
    max_model_len: int  # longest prompt + completion the engine serves

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        params: SamplingParams,
        interrupt: InterruptPoll | None = None,
    ) -> list[list[Completion]]:
        """`n` completions for each prompt (token ids); result[i][j] is prompt i's j-th.
        Each completion's budget is max_new_tokens, cut so prompt + completion fits
        `max_model_len`."""
        seqs = [
            SequenceState(list(p), min(params.max_new_tokens, self.max_model_len - len(p)))
            for p in prompts
            for _ in range(n)
        ]
        too_long = [i for i, s in enumerate(seqs) if s.budget < 1]
        if too_long:
            p = seqs[too_long[0]].prompt
            raise ValueError(
                f"prompt of {len(p)} tokens leaves no room within max_model_len={self.max_model_len}"
            )
        poll = interrupt if params.on_new_weights != "finish" else None
        while True:
            active = [s for s in seqs if s.active]
            if not active:
                break
            update = self._decode_round(active, params, poll)
            if update is None:
                break
            self.load_weights(update.tensors, update.version)
            if params.on_new_weights == "abort":
                for s in active:
                    if s.active:
                        s.restart()
        done = [s.completion() for s in seqs]
        return [done[i * n : (i + 1) * n] for i in range(len(prompts))]

    @abstractmethod
    def _decode_round(
        self, seqs: list[SequenceState], params: SamplingParams, interrupt: InterruptPoll | None
    ) -> WeightUpdate | None:
        """Prefill every sequence's prefix, then sample until each is finished or out of
        budget (appending to the states), checking `interrupt` after every decode step.
        Returns the update that interrupted the round, or None when the round ran out."""

    @abstractmethod
    def load_weights(self, tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Replace the weights in place (no restart) and tag later tokens with `version`."""

    def close(self) -> None:  # noqa: B027 - engines with processes or files override it
        """Release what the engine holds (processes, shared memory)."""
