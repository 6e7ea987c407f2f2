"""Turn leased LLM trajectories into padded tensors for one training step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sluice.learner.packing import PackedRows, no_kv_cache
from sluice.modeling.sampling import SamplingTransform, sampling_logprobs
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
    truncated: torch.Tensor  # [B] bool: cut at the token budget (the rollout's info["truncated"])
    packed: PackedRows | None = None  # the forward's packed layout (learner/packing.py); None: padded

    @property
    def n_tokens(self) -> int:
        return int(self.completion_mask.sum())


def collate(trajs: Sequence[Trajectory], pad_id: int) -> TokenBatch:
    """Right-padded tensors of a batch, built with a handful of numpy ops over the whole
    batch (a per-row loop of tensor writes cost ~9% of a tiny model's step)."""
    prompts = [np.asarray(t.arrays["prompt_ids"]) for t in trajs]
    comps = [np.asarray(t.arrays["completion_ids"]) for t in trajs]
    p_len = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=len(trajs))
    n_len = p_len + np.fromiter((len(c) for c in comps), dtype=np.int64, count=len(trajs))
    width = int(n_len.max())
    col = np.arange(width)
    filled = col[None, :] < n_len[:, None]  # [B, L]: prompt + completion positions
    input_ids = np.full((len(trajs), width), pad_id, dtype=np.int64)
    input_ids[filled] = np.concatenate([x for pc in zip(prompts, comps) for x in pc])
    # target position j predicts token j+1: completion tokens are targets len(p)-1 .. n-2
    col = col[: width - 1]
    targets = (col[None, :] >= p_len[:, None] - 1) & (col[None, :] < n_len[:, None] - 1)
    behav = np.zeros((len(trajs), width - 1), dtype=np.float32)
    behav[targets] = np.concatenate([np.asarray(t.arrays["behaviour_logprobs"]) for t in trajs])
    # Multi-turn trajectories mark environment tokens with loss_mask 0: not trained on.
    comp = targets.copy()
    if any("loss_mask" in t.arrays for t in trajs):
        comp[targets] = np.concatenate([_loss_mask(t) for t in trajs])
    ids = torch.from_numpy(input_ids)
    return TokenBatch(
        input_ids=ids,
        attention_mask=torch.from_numpy(filled.astype(np.int64)),
        targets=ids[:, 1:],
        completion_mask=torch.from_numpy(comp),
        behaviour_logprobs=torch.from_numpy(behav),
        rewards=torch.tensor([t.reward for t in trajs], dtype=torch.float32),
        versions=torch.tensor([t.version for t in trajs], dtype=torch.long),
        group_ids=[t.group_id for t in trajs],
        truncated=torch.tensor([bool(t.info.get("truncated", False)) for t in trajs]),
    )


def _loss_mask(t: Trajectory) -> np.ndarray:
    m = t.arrays.get("loss_mask")
    n = len(t.arrays["completion_ids"])
    return np.ones(n, dtype=bool) if m is None else np.asarray(m).astype(bool)


def token_logprobs(model: torch.nn.Module, batch: TokenBatch, sampling: SamplingTransform) -> torch.Tensor:
    """log pi_theta(target) of every position under the rollouts' sampling transform
    (temperature, then the top_k/top_p/min_p filters), the target always kept: [B, L-1].
    Finite everywhere, also for a sampled token the current filters drop
    (sluice/modeling/sampling.py says why)."""
    return token_logprobs_and_entropy(model, batch, sampling, entropy=False)[0]


def token_logprobs_and_entropy(
    model: torch.nn.Module, batch: TokenBatch, sampling: SamplingTransform, entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs`, and (`entropy`) the entropy of the distribution sampled from at every
    position, [B, L-1], from the same forward (with gradient: an entropy bonus takes it).
    With `batch.packed`, the forward runs on the packed rows and both come back padded."""
    packed = batch.packed
    if packed is None:
        inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        logits, targets = model(**inputs, **no_kv_cache(model)).logits[:, :-1], batch.targets
    else:
        inputs = {"input_ids": packed.input_ids, "position_ids": packed.position_ids}
        logits = model(**inputs, **no_kv_cache(model)).logits
        targets = packed.input_ids.roll(-1, dims=1)  # a row's last target is never gathered
    logp = sampling_logprobs(logits, sampling, keep=targets)
    target = logp.gather(-1, targets[..., None]).squeeze(-1)
    ent = None
    if entropy:
        # a filtered token has p = 0 and log p = -inf: it adds 0, and no NaN to the gradient
        ent = -(logp.exp() * logp.masked_fill(logp.isinf(), 0.0)).sum(-1)
    if packed is not None:
        target = target.flatten()[packed.index]
        ent = ent.flatten()[packed.index] if ent is not None else None
    return target, ent
