"""The sim engine: no model, a latency model of generation. For scale tests.

Many simulated services must fit on one small machine, so this module and everything it
imports stay free of torch and transformers: a sim service is a light Python process whose
time goes into sleeping (the simulated GPU) and into the real buffer and control traffic,
which is what a scale test measures.

Latency of one decode round of `b` sequences with `p` prompt tokens in all, `s` decode steps:

    call_s + prefill_s_per_token * p + s * (decode_step_s + decode_s_per_seq * b)

Tokens are drawn uniformly from the model's vocabulary (end-of-sequence with `eos_prob`), and
their log-probs are those of that sampling distribution, so sim trajectories are valid
trajectories: the learner can train on them and the buffer cannot tell them apart.

Sampling knobs: `stop_token_ids` and `stop` strings end a sequence as in the other engines
(a stop token is drawn like any other word, so it ends a sequence by chance). temperature,
top_k, top_p and min_p are accepted and ignored: there are no logits to transform, and the
reported log-probs stay those of the distribution actually sampled from (uniform words,
end-of-sequence with `eos_prob`).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterable, Sequence
from typing import Any

from sluice.config.rollout import SimEngineConfig
from sluice.rollout_svc.engines.base import (
    Engine,
    InterruptPoll,
    SamplingParams,
    SequenceState,
    WeightUpdate,
    completes_stop,
)

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"


class WordTokenizer:
    """Word-level tokenizer with the same ids as `sluice.modeling.build_tokenizer` (specials
    first: pad=0, bos=1, eos=2, unk=3), without importing transformers."""

    def __init__(self, tokens: Sequence[str]) -> None:
        self.itos = [PAD, BOS, EOS, UNK, *tokens]
        self.stoi = {t: i for i, t in enumerate(self.itos)}
        self.pad_token_id, self.bos_token_id, self.eos_token_id, self.unk_token_id = 0, 1, 2, 3

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [self.stoi.get(w, self.unk_token_id) for w in text.split()]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        words = [self.itos[i] for i in ids]
        if skip_special_tokens:
            words = [w for w in words if w not in (PAD, BOS, EOS, UNK)]
        return " ".join(words)

    def __len__(self) -> int:
        return len(self.itos)


class SimEngine(Engine):
    def __init__(
        self, tokens: Sequence[str], max_model_len: int, cfg: SimEngineConfig, seed: int = 0
    ) -> None:
        self.tokenizer = tokenizer = WordTokenizer(tokens)
        self.max_model_len = max_model_len
        self.cfg = cfg
        self.version = 0
        self.rng = random.Random(seed)
        self._words = list(range(4, len(tokenizer)))  # every non-special token
        n = len(self._words)
        # log-probs of the sampling distribution: eos with eos_prob, the rest uniform
        self._eos_logp = math.log(cfg.eos_prob) if cfg.eos_prob > 0 else -math.inf
        self._word_logp = math.log((1 - cfg.eos_prob) / n) if cfg.eos_prob < 1 else -math.inf
        self.sleep = time.sleep  # tests may replace the clock

    def _sample(self) -> tuple[int, float]:
        if self.rng.random() < self.cfg.eos_prob:
            return self.tokenizer.eos_token_id, self._eos_logp
        return self.rng.choice(self._words), self._word_logp

    def _decode_round(
        self, seqs: list[SequenceState], params: SamplingParams, interrupt: InterruptPoll | None
    ) -> WeightUpdate | None:
        c = self.cfg
        stop_ids = {self.tokenizer.eos_token_id, *params.stop_token_ids}
        self.sleep(c.call_s + c.prefill_s_per_token * sum(len(s.prefix) for s in seqs))
        while True:
            live = [s for s in seqs if s.active]
            if not live:
                return None
            self.sleep(c.decode_step_s + c.decode_s_per_seq * len(live))
            for s in live:
                tok, logp = self._sample()
                ends = tok in stop_ids or (
                    bool(params.stop) and completes_stop(self.tokenizer, [*s.tokens, tok], params.stop)
                )
                s.append(tok, logp, self.version, ends)
            if interrupt is not None and (update := interrupt()) is not None:
                return update

    def load_weights(self, tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """The sim has no weights: it only takes the version."""
        self.version = version
