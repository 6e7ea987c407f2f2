"""Engine test helpers: what the learner computes for completions an engine sampled, and a
weight update that lands mid-generation.

The log-probs come from the learner's own code (`learner.batch.collate`, `token_logprobs`), so a
match means the behaviour log-probs a rollout reports are the numbers the learner's importance
ratios use.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sluice.learner.batch import collate, token_logprobs
from sluice.modeling import load_policy
from sluice.modeling.sampling import SamplingTransform
from sluice.rollout_svc.engines.base import Completion, SamplingParams, WeightUpdate
from sluice.trajectory import Trajectory


def learner_logprobs(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    groups: Sequence[Sequence[Completion]],
    sampling: SamplingTransform | float,
    pad_id: int,
) -> list[list[np.ndarray]]:
    """log pi(token) of every completion token under `model`, as the learner computes it
    (`sampling`: the rollouts' transform, or a temperature alone)."""
    if not isinstance(sampling, SamplingTransform):
        sampling = SamplingTransform(temperature=sampling)
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
        logp = token_logprobs(model, batch, sampling)
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
    sampling: SamplingTransform | float,
    pad_id: int,
) -> float:
    """Largest |behaviour log-prob - learner log-prob| over all tokens, each token checked
    against the weights of the version that sampled it (`weights[version]`)."""
    worst = 0.0
    checked = 0
    for version, state in weights.items():
        model.load_state_dict(state, strict=False)
        ref = learner_logprobs(model, prompts, groups, sampling, pad_id)
        for g, rg in zip(groups, ref):
            for c, r in zip(g, rg):
                sel = c.versions == version
                if sel.any():
                    worst = max(worst, float(np.abs(c.logprobs[sel] - r[sel]).max()))
                    checked += int(sel.sum())
    assert checked == sum(len(c.token_ids) for g in groups for c in g), "a token's version has no weights"
    return worst


def stop_reasons(codec: Any, groups: Sequence[Sequence[Completion]], params: SamplingParams) -> Counter[str]:
    """Why each completion ended (eos, stop_token, stop_string, budget), checking that it
    ended at its first end and not later: no earlier token is a stop token, no shorter prefix
    decodes to text holding a stop string, `finished` unless it ran out of budget."""
    stop_ids = set(params.stop_token_ids)
    reasons: Counter[str] = Counter()
    for g in groups:
        for c in g:
            toks = c.token_ids.tolist()
            texts = [codec.decode(toks[:k], skip_special_tokens=True) for k in range(len(toks) + 1)]
            for k in range(1, len(toks)):
                assert toks[k - 1] not in stop_ids | {codec.eos_token_id}, (toks, k)
                assert not any(s in texts[k] for s in params.stop), (toks, texts[k])
            if toks and toks[-1] == codec.eos_token_id:
                reason = "eos"
            elif toks and toks[-1] in stop_ids:
                reason = "stop_token"
            elif any(s in texts[-1] for s in params.stop):
                reason = "stop_string"
            else:
                reason = "budget"
                assert len(toks) == params.max_new_tokens, toks
            assert c.finished == (reason != "budget"), (toks, reason)
            reasons[reason] += 1
    return reasons


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
