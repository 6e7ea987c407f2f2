"""GRPO advantages and loss against hand-computed values; behaviour log-probs vs the learner."""

from __future__ import annotations

import math

import numpy as np
import torch
from helpers.engines import learner_logprobs

from sluice.config.model import ModelConfig
from sluice.learner.losses.grpo import group_advantages, group_indices, grpo_loss
from sluice.modeling import load_policy, materialize_model_dir
from sluice.rollout_svc.engines.base import SamplingParams
from sluice.rollout_svc.engines.hf import HFEngine


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5])
    idx = group_indices(["a", "a", "a", "a", "b", "b"])
    adv = group_advantages(rewards, idx, eps=1e-8)
    # group a: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735
    s = math.sqrt(1 / 3)
    assert torch.allclose(adv[:4], torch.tensor([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s]))
    assert torch.equal(adv[4:], torch.zeros(2))  # no variance, no signal
    centred = group_advantages(rewards, idx, normalize_std=False)
    assert torch.allclose(centred, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0]))


def test_grpo_loss_by_hand():
    # two sequences, two tokens each; the second token of sequence 1 is padding
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.0, -2.5], [-1.5, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1], [1, 0]])
    out = grpo_loss(logp, behaviour, adv, mask, is_cap=2.0)
    assert out.loss.requires_grad
    # IS weights: exp(0)=1, exp(0.5)=1.6487, exp(1)=2.718 -> capped at 2
    w = [1.0, math.exp(0.5), 2.0]
    expected = -(w[0] * 1 * -1.0 + w[1] * 1 * -2.0 + w[2] * -2 * -0.5) / 3
    assert math.isclose(out.loss.item(), expected, rel_tol=1e-6)
    assert math.isclose(out.metrics["is_truncated_frac"], 1 / 3, rel_tol=1e-6)
    out.loss.backward()
    # d loss / d logp = -w * A / n_tokens on real tokens, 0 on padding
    grad = torch.tensor([[-w[0] / 3, -w[1] / 3], [-w[2] * -2 / 3, 0.0]])
    assert torch.allclose(logp.grad, grad, atol=1e-6)


def test_behaviour_logprobs_match_learner_recompute(tmp_path):
    """What the rollout engine reports as mu(token) is what the learner computes for the same
    weights: different padding and batching, same numbers within float tolerance."""
    model_dir = materialize_model_dir(ModelConfig(), tmp_path)
    engine = HFEngine(model_dir, seed=3)
    model, tok = load_policy(model_dir)
    prompts = [[tok.bos_token_id, 5, 6, 7, 14], [tok.bos_token_id, 9, 14]]  # different lengths
    for temperature in (1.0, 0.7):
        groups = engine.generate(prompts, n=4, params=SamplingParams(6, temperature))
        recomputed = learner_logprobs(model, prompts, groups, temperature, tok.pad_token_id)
        diffs = [np.abs(c.logprobs - r) for g, rg in zip(groups, recomputed) for c, r in zip(g, rg)]
        assert sum(d.size for d in diffs) > 0
        worst = max(float(d.max()) for d in diffs if d.size)
        assert worst < 1e-4, worst
