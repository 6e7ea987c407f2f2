"""Sequence packing for the policy's forward (learner/packing.py): the packed forward gives the
padded one's log-probs, entropies, losses and gradients; rows hold each sequence once; a model
whose packed forward differs is trained padded."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest
import torch

from sluice.config import load_config
from sluice.learner.batch import collate, token_logprobs_and_entropy
from sluice.learner.dist import DistContext
from sluice.learner.losses.aggregate import Denominator
from sluice.learner.packing import first_fit, packs_like_padding, plan
from sluice.modeling.sampling import SamplingTransform
from sluice.trajectory import Trajectory

TINY = ["model.init.hidden_size=16", "model.init.intermediate_size=32", "model.init.num_layers=2"]


def tiny_policy(tmp_path, overrides=()):
    from sluice.modeling import load_policy
    from sluice.modeling.policy import materialize_policy_dir

    cfg = load_config(None, [f"run.dir={tmp_path}", *TINY, *overrides])
    model_dir = materialize_policy_dir(cfg)
    model, tok = load_policy(model_dir)
    return cfg, model_dir, model, tok


def trajectories(lengths, prompt=3, groups=2) -> list[Trajectory]:
    rng = np.random.default_rng(0)
    return [
        Trajectory(
            traj_id=f"t{i}",
            group_id=f"g{i % groups}",
            version=0,
            group_size=len(lengths) // groups,
            reward=float(rng.random()),
            arrays={
                "prompt_ids": np.concatenate([[1], rng.integers(3, 13, prompt - 1)]).astype(np.int32),
                "completion_ids": rng.integers(3, 13, n).astype(np.int32),
                "behaviour_logprobs": rng.uniform(-3, -1, n).astype(np.float32),
            },
        )
        for i, n in enumerate(lengths)
    ]


def test_rows_hold_every_sequence_once_and_within_their_width():
    rng = np.random.default_rng(1)
    for _ in range(50):
        lengths = rng.integers(1, 20, rng.integers(1, 40))
        width = int(lengths.max()) * int(rng.integers(1, 3))
        row, offset, rows = first_fit(lengths, width)
        used = np.zeros((rows, width), dtype=int)
        for r, o, n in zip(row, offset, lengths):
            used[r, o : o + n] += 1
        assert used.max() == 1 and used.sum() == lengths.sum()
        assert rows <= len(lengths)


def test_the_packed_forward_gives_the_padded_logprobs_entropies_and_gradients(tmp_path):
    _, _, model, tok = tiny_policy(tmp_path)
    batch = collate(trajectories([1, 9, 2, 4, 3, 12, 2, 5]), tok.pad_token_id)
    packed = plan(batch.input_ids, batch.attention_mask, tok.pad_token_id, 0.0)
    assert packed is not None and packed.input_ids.numel() < batch.input_ids.numel()
    sampling = SamplingTransform(temperature=0.7, top_k=8)
    results = []
    for layout in (None, packed):
        batch = replace(batch, packed=layout)
        if layout is not None:
            batch.input_ids = torch.zeros_like(batch.input_ids)  # the packed forward reads only its rows
        model.zero_grad()
        logp, ent = token_logprobs_and_entropy(model, batch, sampling)
        assert ent is not None
        mask = batch.completion_mask
        ((logp * mask).sum() + (ent * mask).sum()).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        results.append((logp.detach()[mask], ent.detach()[mask], grads))
    (a_logp, a_ent, a_grads), (b_logp, b_ent, b_grads) = results
    assert all(torch.isfinite(g).all() for g in a_grads)  # filtered tokens' entropy terms add no NaN
    assert torch.allclose(a_logp, b_logp, atol=1e-5) and torch.allclose(a_ent, b_ent, atol=1e-5)
    for a, b in zip(a_grads, b_grads):
        assert torch.allclose(a, b, atol=1e-5)


def test_a_batch_packing_would_not_shrink_is_padded():
    ids = torch.ones((4, 6), dtype=torch.long)
    assert plan(ids, torch.ones_like(ids), 0, 0.0) is None  # every row full


def test_short_sequences_share_rows_twice_as_wide_where_that_computes_less():
    lengths = [17] + [9] * 15  # two 9s do not fit a row of 17; three fit one of 34
    ids = torch.ones((16, 17), dtype=torch.long)
    mask = (torch.arange(17)[None] < torch.tensor(lengths)[:, None]).long()
    packed = plan(ids, mask, 0, 0.0)
    assert packed is not None and packed.input_ids.shape == (6, 34)
    heavy = plan(ids, mask, 0, 1.0)  # attention dominating: no row wider than the widest sequence
    assert heavy is None


@pytest.mark.parametrize(
    "overrides",
    [
        ["workflow=grpo"],
        ["learner.loss.type=decoupled_ppo", "learner.llm.kl_coef=0.1"],
        ["workflow=gspo"],
        ["learner.loss.type=grpo", "learner.llm.aggregation=sequence"],
        ["workflow=ppo_critic"],  # the value model's forward packs too
    ],
)
def test_the_objective_gives_the_same_loss_packed_or_padded_whole_and_in_micro_batches(tmp_path, overrides):
    from sluice.config.workflow_check import effective_workflow
    from sluice.learner.objectives.token import TokenObjective

    cfg, model_dir, model, tok = tiny_policy(tmp_path, overrides)
    with torch.no_grad():
        for p in model.parameters():  # pi differs from the reference (the saved initial weights)
            p.add_(0.05 * torch.randn_like(p))
    trajs = trajectories([1, 9, 2, 4, 3, 12, 2, 5])
    losses = []
    for weight in (None, 0.0):
        obj = TokenObjective(
            effective_workflow(cfg).learner, tok.pad_token_id, tok.bos_token_id, SamplingTransform(),
            torch.device("cpu"), model_dir, pack_attention=weight,
        )  # fmt: skip
        piece = obj.prepare(model, trajs, DistContext())
        assert (piece.batch.packed is not None) == (weight is not None)
        denom = Denominator(*obj.counts(piece))
        parts = obj.micro(piece, 3)
        assert any(p.batch.packed is not None for p in parts) == (weight is not None)  # each packs alone
        losses.append((obj.loss(model, piece, denom)[0], sum(obj.loss(model, p, denom)[0] for p in parts)))
    (whole, micro), (whole_packed, micro_packed) = losses
    assert torch.allclose(whole, whole_packed, atol=1e-5) and torch.allclose(micro, micro_packed, atol=1e-5)
    assert torch.allclose(whole, micro, atol=1e-5)


class CrossAttending(torch.nn.Module):
    """A causal LM whose forward ignores position ids: packed sequences see each other."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


def test_a_model_whose_packed_forward_differs_is_trained_padded(tmp_path, caplog):
    from sluice.learner.trainer import pack_attention

    cfg, _, model, tok = tiny_policy(tmp_path)
    cpu = torch.device("cpu")
    assert packs_like_padding(model, tok.pad_token_id, len(tok), cpu)
    assert pack_attention(cfg, model, tok, cpu) is not None
    with caplog.at_level(logging.WARNING, logger="sluice.learner.trainer"):
        assert pack_attention(cfg, CrossAttending(model), tok, cpu) is None
    assert "pack_sequences" in caplog.text
    off = load_config(None, [f"run.dir={tmp_path}", *TINY, "learner.pack_sequences=false"])
    assert pack_attention(off, model, tok, cpu) is None


def test_the_value_model_gives_the_padded_values_on_packed_rows(tmp_path):
    from sluice.learner.critic import Critic

    _, model_dir, _, tok = tiny_policy(tmp_path)
    critic = Critic(model_dir, "float32", torch.device("cpu"), lr=1e-3, grad_clip=1.0)
    with torch.no_grad():
        critic.head.weight.normal_()  # zero at the start: values of 0 would say nothing
    batch = collate(trajectories([1, 9, 2, 4, 3, 12, 2, 5]), tok.pad_token_id)
    padded = critic.values(batch)
    packed = replace(batch, packed=plan(batch.input_ids, batch.attention_mask, tok.pad_token_id, 0.0))
    assert packed.packed is not None
    packed.input_ids = torch.zeros_like(batch.input_ids)  # the packed forward reads only its rows
    mask = batch.completion_mask
    assert torch.allclose(padded[mask], critic.values(packed)[mask], atol=1e-5)


def test_a_steps_forward_fill_is_the_share_of_computed_positions_holding_a_token(tmp_path):
    from sluice.learner.trainer import Trainer

    lengths = [1, 9, 2, 4, 3, 12, 2, 5]  # completions, after 3 prompt tokens
    fills = {}
    for pack in ("false", "true"):
        cfg, model_dir, _, _ = tiny_policy(
            tmp_path / pack,
            ["rollout.group_size=4", "learner.batch_size=8", f"learner.pack_sequences={pack}"],
        )
        stats = Trainer(cfg, DistContext(), model_dir).train_step(trajectories(lengths))
        fills[pack] = stats["forward_fill"]
    tokens = sum(lengths) + 3 * len(lengths)
    assert fills["false"] == pytest.approx(tokens / (len(lengths) * (12 + 3)))
    assert fills["true"] > fills["false"]
