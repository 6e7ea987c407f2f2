"""Losses by reference: `learner.loss` is a union tagged by `type` (a knob of another loss is a
config error naming the key), a user's loss given as `file.py:fn` is called through the same
table as the built-ins, and its params are validated by its own model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers.groups import group_of

from sluice.config import ConfigError, load_config
from sluice.config.loader import config_from_dict
from sluice.config.loss import CustomLoss, GrpoLoss, PPOLoss
from sluice.learner.dist import DistContext
from sluice.learner.losses.aggregate import Denominator
from sluice.learner.losses.base import TokenLossInputs
from sluice.learner.losses.grpo import group_advantages, group_indices
from sluice.learner.losses.plugin import check_loss
from sluice.learner.losses.registry import token_loss
from sluice.learner.trainer import build_objective
from sluice.modeling import load_policy
from sluice.modeling.policy import materialize_policy_dir
from sluice.plugins import PluginError, resolve

LOSS_FILE = '''
import torch
from pydantic import Field

from sluice.config.base import Section
from sluice.learner.losses.base import LossOutput

CALLS = []


class Params(Section):
    scale: float = Field(default=1.0, gt=0)


def reinforce(inputs, params):
    """REINFORCE on sequence advantages: -scale * A * log pi, aggregated like the built-ins."""
    CALLS.append((inputs, params))
    per_token = -params.scale * inputs.advantages[:, None] * inputs.logprobs
    abs_adv = (inputs.advantages.abs()[:, None] * torch.ones_like(inputs.logprobs)).detach()
    return LossOutput(inputs.aggregate(per_token), {"abs_adv_mean": inputs.aggregate(abs_adv)})


reinforce.Params = Params


def untyped(inputs, params):
    return LossOutput(inputs.aggregate(-params["scale"] * inputs.advantages[:, None] * inputs.logprobs))


def not_an_output(inputs, params):
    return 1.0


class AClass:
    pass
'''


@pytest.fixture
def loss_file(tmp_path):
    path = tmp_path / "my_losses.py"
    path.write_text(LOSS_FILE)
    return path


def one_line_error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_a_knob_of_another_loss_is_a_config_error_naming_the_key():
    msg = one_line_error(["learner.loss.type=grpo", "learner.loss.clip_high=0.28"])
    assert msg == "config error: learner.loss.clip_high: unknown key for learner.loss.type=grpo"
    msg = one_line_error(["learner.loss.type=ppo", "learner.loss.is_cap=3"])
    assert "learner.loss.is_cap: unknown key for learner.loss.type=ppo" in msg
    msg = one_line_error(["learner.loss.type=ppo", "learner.loss.clip_low=2"])
    assert msg.startswith("config error: learner.loss.clip_low: Input should be less than 1")
    # a knob of the other objective: classic RL's under an LLM run, and the other way round
    msg = one_line_error(["learner.classic.gamma=0.9"])
    assert msg.startswith("config error: learner.classic.gamma: a classic-RL setting")
    classic = ["rollout.kind=env", "model.kind=mlp", "learner.loss.type=vtrace"]
    msg = one_line_error([*classic, "learner.llm.kl_coef=0.1", "learner.classic.gae_lambda=0.9"])
    assert "learner.llm.kl_coef: an LLM setting" in msg
    assert "learner.classic.gae_lambda: not read by learner.loss.type=vtrace" in msg
    assert "learner.loss.type: grpo is for LLM tokens" in one_line_error(classic[:2])


def test_an_unknown_type_lists_the_built_ins():
    msg = one_line_error(["learner.loss.type=nope"])
    assert msg.startswith("config error: learner.loss.type: not a built-in loss")
    assert all(repr(name) in msg for name in ("grpo", "ppo", "decoupled_ppo", "vtrace"))
    assert msg.endswith("(got 'nope')")


def test_each_type_picks_its_model_and_a_dumped_config_loads_again(loss_file):
    assert isinstance(load_config(None).learner.loss, GrpoLoss)
    ppo = load_config(None, ["learner.loss.type=ppo", "learner.loss.clip_high=0.28"])
    assert isinstance(ppo.learner.loss, PPOLoss) and ppo.learner.loss.clip_high == 0.28
    custom = load_config(None, [f"learner.loss.type={loss_file}:reinforce", "learner.loss.params={scale: 2}"])
    assert isinstance(custom.learner.loss, CustomLoss) and custom.learner.loss.params == {"scale": 2}
    classic = load_config("configs/cartpole.yaml")
    for cfg in (ppo, custom, classic):  # the launcher hands roles a full dump: every key set
        again = config_from_dict(cfg.model_dump(mode="json"))
        assert again.learner == cfg.learner


def test_a_custom_file_loss_is_called_through_the_table_and_matches_the_hand_value(loss_file):
    cfg = load_config(None, [f"learner.loss.type={loss_file}:reinforce", "learner.loss.params={scale: 2}"])
    fn, params = token_loss(cfg.learner.loss)
    assert params.scale == 2.0  # validated by the loss's Params: a model, not the dict
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1], [1, 0]])  # the second token of sequence 1 is padding
    x = TokenLossInputs(logp, logp.detach(), None, adv, mask, "token", Denominator.of(mask))
    out = fn(x, params)
    # -2 * (1 * -1 + 1 * -2 + -2 * -0.5) / 3 tokens
    assert math.isclose(out.loss.item(), -2 * (-1 - 2 + 1) / 3, rel_tol=1e-6)
    assert math.isclose(out.metrics["abs_adv_mean"].item(), (1 + 1 + 2) / 3, rel_tol=1e-6)
    # with behaviour = current policy the IS weights are 1: the built-in grpo is REINFORCE
    grpo, grpo_params = token_loss(GrpoLoss())
    assert math.isclose(grpo(x, grpo_params).loss.item(), out.loss.item() / 2, rel_tol=1e-6)
    untyped = CustomLoss(type=f"{loss_file}:untyped", params={"scale": 2})
    fn, params = token_loss(untyped)
    assert params == {"scale": 2} and math.isclose(fn(x, params).loss.item(), out.loss.item())
    fn, params = token_loss(CustomLoss(type=f"{loss_file}:not_an_output"))
    with pytest.raises(TypeError, match="not_an_output' returned a float, not a LossOutput"):
        fn(x, params)


def test_custom_loss_params_are_validated_by_its_model(loss_file):
    ref = f"learner.loss.type={loss_file}:reinforce"
    for params, expected in [
        ("{scale: -1}", "config error: learner.loss.params.scale: Input should be greater than 0 (got -1)"),
        ("{scael: 1}", "config error: learner.loss.params.scael: unknown key"),
    ]:
        cfg = load_config(None, [ref, f"learner.loss.params={params}"])
        with pytest.raises(ConfigError) as e:
            check_loss(cfg.learner.loss)
        assert str(e.value) == expected
    msg = one_line_error([ref, "learner.loss.scale=2"])  # settings go under params
    assert "learner.loss.scale: unknown key" in msg


def test_a_reference_that_does_not_resolve_is_one_line_naming_the_key(loss_file):
    cfg = load_config(None, ["learner.loss.type=no_such_pkg.losses:fn"])  # syntactic: it loads
    with pytest.raises(PluginError) as e:
        check_loss(cfg.learner.loss)
    msg = str(e.value)
    assert msg.startswith("config error: learner.loss.type: 'no_such_pkg.losses:fn': cannot import")
    assert "ModuleNotFoundError" in msg and "\n" not in msg
    with pytest.raises(PluginError, match=r"learner.loss.type: .*has no attribute 'nothing'"):
        check_loss(CustomLoss(type=f"{loss_file}:nothing"))
    with pytest.raises(PluginError, match="is the class AClass; a loss is a function"):
        check_loss(CustomLoss(type=f"{loss_file}:AClass"))
    msg = one_line_error(["rollout.kind=env", "model.kind=mlp", f"learner.loss.type={loss_file}:reinforce"])
    assert "learner.loss.type: " in msg and "is a custom loss, for LLM tokens" in msg


def test_the_learner_builds_its_objective_with_a_custom_loss_and_trains_on_it(tmp_path, loss_file):
    cfg = load_config(
        None,
        [
            f"run.dir={tmp_path / 'run'}",
            "model.init.hidden_size=16",
            "model.init.intermediate_size=32",
            "model.init.num_layers=1",
            "model.init.head_dim=8",
            f"learner.loss.type={loss_file}:reinforce",
            "learner.loss.params={scale: 3}",
            "learner.loss.recompute_proximal=true",
        ],
    )
    model_dir = materialize_policy_dir(cfg)
    model, tok = load_policy(model_dir)
    obj = build_objective(cfg, model, tok, model_dir, torch.device("cpu"))
    arrays = [
        {
            "prompt_ids": np.arange(3, dtype=np.int32),
            "completion_ids": (np.arange(n) + 3).astype(np.int32),
            "behaviour_logprobs": np.full(n, -0.5, np.float32),
        }
        for n in (2, 3, 4, 5)
    ]
    rewards = [0.0, 1.0, 1.0, 3.0]
    trajs = group_of("g0", arrays[:2], rewards=rewards[:2]) + group_of("g1", arrays[2:], rewards=rewards[2:])
    piece = obj.prepare(model, trajs, DistContext())
    denom = Denominator(*obj.counts(piece))
    loss, stats = obj.loss(model, piece, denom)
    module = resolve(cfg.learner.loss.type, "losses", "test").__globals__  # loaded once per process
    ((x, params),) = module["CALLS"]
    assert params.scale == 3.0 and x.denom == denom and x.aggregation == "token"
    expected_adv = group_advantages(torch.tensor(rewards), group_indices([t.group_id for t in trajs]))
    assert torch.allclose(x.advantages, expected_adv)
    assert x.proximal_logprobs is not None and x.proximal_logprobs.shape == x.logprobs.shape
    assert torch.equal(x.mask, piece.batch.completion_mask) and denom.tokens == 2 + 3 + 4 + 5
    by_hand = -3 * (x.advantages[:, None] * x.logprobs.detach() * x.mask).sum() / denom.tokens
    assert torch.allclose(loss, by_hand) and torch.allclose(stats["policy_loss"], by_hand)
    # the loss's own metrics, beside the objective's size of the forward (forward_fill's parts)
    assert set(stats) == {"abs_adv_mean", "policy_loss", "forward_tokens", "forward_positions"}
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
