"""Turn leased LLM trajectories into padded tensors for one training step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from sluice.trajectory import Trajectory


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # [B, L] prompt + completion, right-padded with pad_id
    attention_mask: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, L-1] next-token ids (input_ids shifted left)
    completion_mask: torch.Tensor  # [B, L-1] True where the target is a model-sampled completion token
    behaviour_logprobs: torch.Tensor  # [B, L-1] mu(target), 0 outside completions
    rewards: torch.Tensor  # [B]
    versions: torch.Tensor  # [B] trajectory versions (oldest token)
    group_ids: list[str]

    @property
    def n_tokens(self) -> int:
        return int(self.completion_mask.sum())


def collate(trajs: Sequence[Trajectory], pad_id: int) -> TokenBatch:
    rows = []
    for t in trajs:
        p = np.asarray(t.arrays["prompt_ids"], dtype=np.int64)
        c = np.asarray(t.arrays["completion_ids"], dtype=np.int64)
        # Multi-turn trajectories mark environment tokens with loss_mask 0: not trained on.
        m = t.arrays.get("loss_mask")
        m = np.ones(len(c), dtype=bool) if m is None else np.asarray(m).astype(bool)
        rows.append((p, c, np.asarray(t.arrays["behaviour_logprobs"], dtype=np.float32), m))
    width = max(len(p) + len(c) for p, c, _, _ in rows)
    b = len(rows)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    comp = torch.zeros((b, width - 1), dtype=torch.bool)
    behav = torch.zeros((b, width - 1), dtype=torch.float32)
    for i, (p, c, lp, m) in enumerate(rows):
        n = len(p) + len(c)
        input_ids[i, :n] = torch.from_numpy(np.concatenate([p, c]))
        attn[i, :n] = 1
        # target position j predicts token j+1: completion tokens are targets len(p)-1 .. n-2
        comp[i, len(p) - 1 : n - 1] = torch.from_numpy(m)
        behav[i, len(p) - 1 : n - 1] = torch.from_numpy(lp)
    return TokenBatch(
        input_ids=input_ids,
        attention_mask=attn,
        targets=input_ids[:, 1:],
        completion_mask=comp,
        behaviour_logprobs=behav,
        rewards=torch.tensor([t.reward for t in trajs], dtype=torch.float32),
        versions=torch.tensor([t.version for t in trajs], dtype=torch.long),
        group_ids=[t.group_id for t in trajs],
    )


def token_logprobs(model: torch.nn.Module, batch: TokenBatch, temperature: float) -> torch.Tensor:
    """log pi_theta(target) of every position under the tempered policy: [B, L-1]."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, batch.targets[..., None]).squeeze(-1)
