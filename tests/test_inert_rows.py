"""Rows without gradient (`learner.skip_zero_advantage`): a group that scored alike has zero
advantages, and under a built-in policy loss the step that leaves it out of its forward and
backward gives the same update, loss and gradient norm as the step that computes it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.groups import group_of

from sluice.config import load_config
from sluice.learner.dist import DistContext
from sluice.learner.trainer import Trainer
from sluice.modeling.policy import materialize_policy_dir
from sluice.trajectory import Trajectory

TINY = ["model.init.hidden_size=16", "model.init.intermediate_size=32", "model.init.num_layers=2"]
LENGTHS = [1, 9, 2, 4, 3, 12, 2, 5, 6, 1, 7, 3]  # completions of 3 groups of 4


def batch(rewards: list[list[float]]) -> list[Trajectory]:
    """Groups with the given rewards (12 rows); behaviour log-probs not the learner's (IS
    weights != 1)."""
    rng = np.random.default_rng(0)
    size = len(rewards[0])
    rows = [
        {
            "prompt_ids": np.asarray([1, 3 + i // size, 4 + i // size], dtype=np.int32),
            "completion_ids": rng.integers(3, 13, n).astype(np.int32),
            "behaviour_logprobs": rng.uniform(-3, -1, n).astype(np.float32),
        }
        for i, n in enumerate(LENGTHS)
    ]
    return [
        t
        for g, r in enumerate(rewards)
        for t in group_of(f"g{g}", rows[g * size : (g + 1) * size], rewards=r)
    ]


def step(tmp_path, skip: bool, trajs: list[Trajectory], overrides=()) -> tuple[dict, dict, dict]:
    """One learner step from the same initial model: (statistics, parameters after it, before)."""
    cfg = load_config(
        None,
        [
            f"run.dir={tmp_path}",
            *TINY,
            f"rollout.group_size={trajs[0].group_size}",
            "learner.batch_size=12",
            "learner.lr=1e-2",
            "learner.grad_clip=100.0",
            f"learner.skip_zero_advantage={str(skip).lower()}",
            *overrides,
        ],
    )
    model_dir = materialize_policy_dir(cfg)
    torch.manual_seed(0)
    trainer = Trainer(cfg, DistContext(), model_dir)
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    stats = trainer.train_step(trajs)
    return stats, {k: v.detach().clone() for k, v in trainer.model.named_parameters()}, before


def assert_same_update(a: tuple, b: tuple, keys=("grad_norm", "policy_loss")) -> None:
    """The same loss and gradient norm (to 1e-5: a missing or doubled share of the gradient
    moves them by far more), and parameters within 1% of one Adam step (lr 1e-2): a weight
    whose gradient is near 0 moves by lr * g / (|g| + eps), which turns a different summation
    order into differences of ~1e-6 (seen: up to 2.8e-6)."""
    (sa, pa, _), (sb, pb, _) = a, b
    for key in keys:
        assert sa[key] == pytest.approx(sb[key], rel=1e-5, abs=1e-7), key
    worst = max(float((pa[k] - pb[k]).abs().max()) for k in pa)
    assert worst < 1e-4, f"max |param diff| {worst}"


ENTROPY = "{stage: entropy_bonus, coef: 0.01}"
USER_LOSS = """
from sluice.learner.losses.base import LossOutput

def reinforce(inputs, params):
    return LossOutput(inputs.aggregate(-inputs.advantages[:, None] * inputs.logprobs))
"""
SIGNAL = [[0.0, 0.25, 1.0, 0.5], [0.75] * 4, [0.0] * 4]  # groups 1 and 2 scored alike


@pytest.mark.parametrize(
    "overrides",
    [
        ["workflow=grpo"],
        ["workflow=gspo"],
        ["workflow=dr_grpo"],
        ["workflow=rloo"],
        ["learner.loss.type=decoupled_ppo"],
        ["learner.loss.type=grpo", "learner.llm.aggregation=sequence", "learner.micro_batches=3"],
    ],
)
def test_leaving_out_rows_without_advantage_gives_the_same_update(tmp_path, overrides):
    trajs = batch(SIGNAL)
    whole = step(tmp_path / "whole", False, trajs, overrides)
    skipped = step(tmp_path / "skip", True, trajs, overrides)
    assert_same_update(whole, skipped)
    assert whole[0]["inert_frac"] == 0.0
    left_out = sum(LENGTHS[4:])  # groups 1 and 2's completion tokens
    assert skipped[0]["inert_frac"] == pytest.approx(left_out / sum(LENGTHS))
    assert skipped[0]["forward_tokens"] < whole[0]["forward_tokens"]  # and they were not computed
    # the step moved the weights: the comparison is not of two untouched models
    after, before = whole[1], whole[2]
    assert max(float((after[k] - before[k]).abs().max()) for k in before) > 1e-3


def test_a_batch_where_every_group_scored_alike_steps_like_the_whole_batch(tmp_path):
    trajs = batch([[1.0] * 4, [0.75] * 4, [0.0] * 4])
    whole = step(tmp_path / "whole", False, trajs)
    skipped = step(tmp_path / "skip", True, trajs)
    assert_same_update(whole, skipped)
    assert skipped[0]["inert_frac"] == 1.0 and skipped[0]["grad_norm"] == 0.0


@pytest.mark.parametrize(
    "overrides",
    [
        ["learner.llm.kl_coef=0.1"],  # the KL term has gradient at a zero advantage
        [f"workflow={{learner: [{{stage: group_advantages}}, {{stage: policy_loss}}, {ENTROPY}]}}"],
        ["workflow=ppo_critic"],  # the value loss trains on every row
        ["learner.loss.type={loss_file}:reinforce"],  # a user's loss: nothing known of it
    ],
)
def test_a_loss_with_gradient_at_zero_advantage_trains_every_row(tmp_path, overrides):
    loss_file = tmp_path / "my_loss.py"
    loss_file.write_text(USER_LOSS)
    overrides = [o.replace("{loss_file}", str(loss_file)) for o in overrides]
    stats = step(tmp_path, True, batch(SIGNAL), overrides)[0]
    assert stats["inert_frac"] == 0.0


def test_a_rows_advantage_that_is_not_exactly_zero_is_trained(tmp_path):
    """Six rewards of 0.9 do not average to exactly 0.9 in float32, and over std + eps their
    advantages are ~6e-4, not 0: the rows have gradient, so they stay."""
    trajs = batch([[0.0, 0.25, 1.0, 0.5, 0.75, 0.0], [0.9] * 6])
    stats = step(tmp_path, True, trajs)[0]
    assert stats["inert_frac"] == 0.0
