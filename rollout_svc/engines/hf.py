"""Generation with a Hugging Face transformers model and a plain sampling loop.

The loop (not `model.generate`) is ours so that every token's log-prob is exactly the
tempered log-softmax the learner recomputes, and so generation has well-defined points
between tokens where weights may change (see `engines/base.py` for the round protocol).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from rollout_svc.engines.base import Engine, InterruptPoll, SamplingParams, SequenceState, WeightUpdate
from sluice.modeling import load_policy


class HFEngine(Engine):
    def __init__(self, model_dir, dtype: str = "float32", device: str = "cpu", seed: int = 0) -> None:
        self.model, self.tokenizer = load_policy(model_dir, dtype, device)
        self.model.eval()
        self.device = torch.device(device)
        self.version = 0
        self.max_model_len = int(self.model.config.max_position_embeddings)
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._params = dict(self.model.named_parameters())

    @torch.no_grad()
    def _decode_round(
        self, seqs: list[SequenceState], params: SamplingParams, interrupt: InterruptPoll | None
    ) -> WeightUpdate | None:
        rows = [s.prefix for s in seqs]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding: every row's last prefix token is aligned
            ids[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1]
        live = torch.tensor([s.active for s in seqs], device=self.device)
        for _ in range(max(s.remaining for s in seqs)):
            logp = F.log_softmax(logits.float() / params.temperature, dim=-1)
            tok = torch.multinomial(logp.exp(), 1, generator=self.generator).squeeze(-1)
            tok_lp = logp.gather(-1, tok[:, None]).squeeze(-1)
            for i in live.nonzero().flatten().tolist():
                seqs[i].append(int(tok[i]), float(tok_lp[i]), self.version, self.eos_id)
            live = torch.tensor([s.active for s in seqs], device=self.device)
            if not bool(live.any()):
                return None
            if interrupt is not None and (update := interrupt()) is not None:
                return update
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
            out = self.model(
                input_ids=tok[:, None],
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            )
            cache, logits = out.past_key_values, out.logits[:, -1]
        return None

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
