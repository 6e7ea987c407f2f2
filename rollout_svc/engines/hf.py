"""Generation with a Hugging Face transformers model and a plain sampling loop.

The loop (not `model.generate`) is ours so that every token's log-prob is exactly the one the
learner recomputes (both use `sluice.modeling.sampling`: temperature, then min_p, top_k,
top_p, as vLLM), and so generation has well-defined points between tokens where weights may
change (see `engines/base.py` for the round protocol). A sequence ends at end-of-sequence, at
a stop token id (both checked in tensors) or at the token completing a stop string (checked
on the host, decoding each live sequence's tail after every step: only when `stop` is set).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from sluice.modeling import load_policy
from sluice.modeling.sampling import SamplingTransform, sampling_logprobs
from sluice.rollout_svc.engines.base import (
    Engine,
    InterruptPoll,
    SamplingParams,
    SequenceState,
    WeightUpdate,
    completes_stop,
)
from sluice.rollout_svc.engines.lean_llama import LeanLlamaDecoder, unsupported_reason

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


class TransformersDecoder:
    """The model's own forward with a DynamicCache: serves every architecture transformers
    does (the lean decoder's interface: `start`, then `step` per token)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def start(self, ids: torch.Tensor, valid: torch.Tensor, steps: int) -> torch.Tensor:
        self.mask = valid.long()
        self.padded = not bool(valid.all())  # no padding: no mask for the model to build
        self.positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=ids, attention_mask=self.mask if self.padded else None,
            position_ids=self.positions, use_cache=True,
        )  # fmt: skip
        self.cache = out.past_key_values
        return out.logits[:, -1]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        self.positions = self.positions[:, -1:] + 1
        out = self.model(
            input_ids=tokens[:, None], attention_mask=self.mask if self.padded else None,
            position_ids=self.positions, past_key_values=self.cache, use_cache=True,
        )  # fmt: skip
        self.cache = out.past_key_values
        return out.logits[:, -1]


def build_decoder(model: PreTrainedModel, choice: str) -> LeanLlamaDecoder | TransformersDecoder:
    """`rollout.hf_decoder`: lean where it reproduces the model (auto), or as asked."""
    if choice == "transformers":
        return TransformersDecoder(model)
    reason = unsupported_reason(model)
    if reason is None:
        return LeanLlamaDecoder(model)
    if choice == "lean":
        raise ValueError(f"rollout.hf_decoder=lean: {reason}")
    log.info("hf engine: transformers forward for decoding (%s)", reason)
    return TransformersDecoder(model)


class HFEngine(Engine):
    def __init__(
        self, model_dir, dtype: str = "float32", device: str = "cpu", seed: int = 0, decoder: str = "auto"
    ) -> None:
        # transformers types its tokenizer loosely (special-token ids through __getattr__, decode
        # returning str | list[str]), so pyright cannot match it to TokenCodec; at run time it does.
        self.model, self.tokenizer = load_policy(model_dir, dtype, device)  # pyright: ignore[reportAttributeAccessIssue]
        self.model.eval()
        self.decoder = build_decoder(self.model, decoder)
        self.device = torch.device(device)
        self.version = 0
        self.max_model_len = int(self.model.config.max_position_embeddings)
        self.eos_id = self.tokenizer.eos_token_id
        pad_id = self.tokenizer.pad_token_id
        if pad_id is None:
            raise ValueError(f"{model_dir}: the tokenizer has no pad token (the hf engine pads batches)")
        self.pad_id = pad_id
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._params = dict(self.model.named_parameters())

    @torch.no_grad()
    def _decode_round(
        self, seqs: list[SequenceState], params: SamplingParams, interrupt: InterruptPoll | None
    ) -> WeightUpdate | None:
        """Sampled tokens and log-probs stay in tensors until the round ends (no per-token
        Python work per sequence, but for the stop-string check when `stop` is set)."""
        steps = max(s.remaining for s in seqs)
        ids, valid = self._left_padded([s.prefix for s in seqs])
        logits = self.decoder.start(ids, valid, steps)
        transform = SamplingTransform.of(params)
        stop_ids = torch.tensor([self.eos_id, *params.stop_token_ids], device=self.device)
        history = [list(s.tokens) for s in seqs] if params.stop else []  # host copy for stop strings
        budget = torch.tensor([s.remaining for s in seqs], device=self.device)
        live = torch.tensor([s.active for s in seqs], device=self.device)
        shape = (len(seqs), steps)
        tokens = torch.empty(shape, dtype=torch.long, device=self.device)
        logps = torch.empty(shape, dtype=torch.float32, device=self.device)
        alive = torch.empty(shape, dtype=torch.bool, device=self.device)
        ends = torch.empty(shape, dtype=torch.bool, device=self.device)
        update, done = None, 0
        for step in range(steps):
            logp = sampling_logprobs(logits, transform)
            tok = torch.multinomial(logp.exp(), 1, generator=self.generator).squeeze(-1)
            tokens[:, step], logps[:, step], alive[:, step] = tok, logp.gather(-1, tok[:, None])[:, 0], live
            ends[:, step] = torch.isin(tok, stop_ids)
            if params.stop:
                ends[:, step] |= self._stop_strings(tok, live, history, params.stop)
            done = step + 1
            live = live & ~ends[:, step] & (budget > done)
            if not bool(live.any()):
                break
            if interrupt is not None and (update := interrupt()) is not None:
                break
            logits = self.decoder.step(tok)
        self._append(seqs, tokens[:, :done], logps[:, :done], alive[:, :done], ends[:, :done])
        return update

    def _stop_strings(
        self, tok: torch.Tensor, live: torch.Tensor, history: list[list[int]], stops: tuple[str, ...]
    ) -> torch.Tensor:
        """Which live rows' new token completes a stop string (`history`: each row's tokens)."""
        hits = []
        for row, t, alive in zip(history, tok.tolist(), live.tolist()):
            if alive:
                row.append(t)
            hits.append(alive and completes_stop(self.tokenizer, row, stops))
        return torch.tensor(hits, dtype=torch.bool, device=live.device)

    def _left_padded(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefixes left-padded to one width (every row's last token aligned), and where the
        real tokens are."""
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        valid = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = torch.tensor(r)
            valid[i, width - len(r) :] = True
        return ids.to(self.device), valid.to(self.device)

    def _append(self, seqs: list[SequenceState], tokens, logps, alive, ends) -> None:
        """Hand the round's samples to the sequences (one host copy for the whole round)."""
        rows = (t.cpu().tolist() for t in (tokens, logps, alive, ends))
        for seq, toks, lps, keep, end in zip(seqs, *rows):
            for tok, lp, k, e in zip(toks, lps, keep, end):
                if k:
                    seq.append(tok, lp, self.version, e)

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        loaded = set()
        for name, tensor in tensors:
            if name not in self._params:
                raise KeyError(f"weight {name!r} is not a parameter of the rollout model")
            self._params[name].copy_(tensor)
            loaded.add(name)
        missing = set(self._params) - loaded
        if missing:
            raise KeyError(f"weight update is missing {len(missing)} parameters, e.g. {sorted(missing)[:3]}")
        self.version = version

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self._params.items()}
