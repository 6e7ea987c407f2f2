"""Engine test helpers: what the learner computes for completions an engine sampled, and a
weight update that lands mid-generation.

The log-probs come from the learner's own code (`learner.batch.collate`, `token_logprobs`), so a
match means the behaviour log-probs a rollout reports are the numbers the learner's importance
ratios use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sluice.learner.batch import collate, token_logprobs
from sluice.modeling import load_policy
from sluice.rollout_svc.engines.base import Completion, WeightUpdate
from sluice.trajectory import Trajectory


def learner_logprobs(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    groups: Sequence[Sequence[Completion]],
    temperature: float,
    pad_id: int,
) -> list[list[np.ndarray]]:
    """log pi(token) of every completion token under `model`, as the learner computes it."""
    trajs = [
        Trajectory(
            traj_id=f"{i}/{j}",
            group_id=str(i),
            version=0,
            arrays={
                "prompt_ids": np.asarray(prompts[i], dtype=np.int32),
                "completion_ids": c.token_ids,
                "behaviour_logprobs": c.logprobs,
            },
        )
        for i, g in enumerate(groups)
        for j, c in enumerate(g)
    ]
    batch = collate(trajs, pad_id)
    with torch.no_grad():
        logp = token_logprobs(model, batch, temperature)
    out, k = [], 0
    for g in groups:
        row = []
        for _ in g:
            row.append(logp[k][batch.completion_mask[k]].numpy())
            k += 1
        out.append(row)
    return out


def max_logprob_error(
    model: torch.nn.Module,
    weights: Mapping[int, Mapping[str, torch.Tensor]],
    prompts: Sequence[Sequence[int]],
    groups: Sequence[Sequence[Completion]],
    temperature: float,
    pad_id: int,
) -> float:
    """Largest |behaviour log-prob - learner log-prob| over all tokens, each token checked
    against the weights of the version that sampled it (`weights[version]`)."""
    worst = 0.0
    checked = 0
    for version, state in weights.items():
        model.load_state_dict(state, strict=False)
        ref = learner_logprobs(model, prompts, groups, temperature, pad_id)
        for g, rg in zip(groups, ref):
            for c, r in zip(g, rg):
                sel = c.versions == version
                if sel.any():
                    worst = max(worst, float(np.abs(c.logprobs[sel] - r[sel]).max()))
                    checked += int(sel.sum())
    assert checked == sum(len(c.token_ids) for g in groups for c in g), "a token's version has no weights"
    return worst


def poll_after(calls: int, update: WeightUpdate) -> Callable[[], WeightUpdate | None]:
    """An interrupt source that delivers `update` at its `calls`-th poll (after that many
    decode steps), like a receiver whose new version lands mid-generation."""
    count = {"n": 0}

    def poll() -> WeightUpdate | None:
        count["n"] += 1
        return update if count["n"] == calls else None

    return poll


def two_versions(model_dir: Path) -> tuple[torch.nn.Module, Any, dict, dict, list[list[int]]]:
    """For engine tests across a weight update: the policy in `model_dir` loaded as the learner
    loads it, its tokenizer, its weights `w0`, other weights `w1` (seeded), and two prompts of
    different lengths."""
    model, tok = load_policy(model_dir)
    w0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    w1 = {k: v + 0.3 * torch.randn(v.shape, generator=gen) for k, v in w0.items()}
    prompts = [[tok.bos_token_id, 5, 6, 7, 14], [tok.bos_token_id, 9, 14]]
    return model, tok, w0, w1, prompts
