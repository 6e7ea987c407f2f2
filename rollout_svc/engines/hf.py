"""Generation with a Hugging Face transformers model and a plain sampling loop.

The loop (not `model.generate`) is ours so that every token's log-prob is exactly the
tempered log-softmax the learner recomputes, and so generation has well-defined points
between tokens where weights may change (interruptible generation builds on it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from rollout_svc.engines.base import Completion, Engine, SamplingParams
from sluice.modeling import load_policy


class HFEngine(Engine):
    def __init__(self, model_dir, dtype: str = "float32", device: str = "cpu", seed: int = 0) -> None:
        self.model, self.tokenizer = load_policy(model_dir, dtype, device)
        self.model.eval()
        self.device = torch.device(device)
        self.version = 0
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._params = dict(self.model.named_parameters())

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[Completion]]:
        rows = [list(p) for p in prompts for _ in range(n)]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding: every row's last prompt token is aligned
            ids[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1]

        tokens, logps = [], []
        done = torch.zeros(len(rows), dtype=torch.bool, device=self.device)
        lengths = torch.zeros(len(rows), dtype=torch.long, device=self.device)
        for _ in range(params.max_new_tokens):
            logp = F.log_softmax(logits.float() / params.temperature, dim=-1)
            tok = torch.multinomial(logp.exp(), 1, generator=self.generator).squeeze(-1)
            tokens.append(tok)
            logps.append(logp.gather(-1, tok[:, None]).squeeze(-1))
            lengths += (~done).long()
            done |= tok == self.eos_id
            if bool(done.all()):
                break
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

        tok_arr = torch.stack(tokens, 1).cpu().numpy().astype(np.int32)
        lp_arr = torch.stack(logps, 1).cpu().numpy().astype(np.float32)
        done_arr = done.cpu().numpy()
        len_arr = lengths.cpu().numpy()
        completions = [
            Completion(
                token_ids=tok_arr[i, : len_arr[i]].copy(),
                logprobs=lp_arr[i, : len_arr[i]].copy(),
                versions=np.full(len_arr[i], self.version, dtype=np.int32),
                finished=bool(done_arr[i]),
            )
            for i in range(len(rows))
        ]
        return [completions[i * n : (i + 1) * n] for i in range(len(prompts))]

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
