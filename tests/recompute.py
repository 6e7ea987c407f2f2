"""Test helper: what the learner computes for completions an engine sampled.

Uses the learner's own code (`learner.batch.collate`, `token_logprobs`), so a match means the
behaviour log-probs a rollout reports are the numbers the learner's importance ratios use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from sluice.learner.batch import collate, token_logprobs
from sluice.rollout_svc.engines.base import Completion
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
