"""The classic-RL path: gymnasium runner segments, the MLP policy, the env objective, configs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sluice.config import (
    ClassicObjectiveConfig,
    ConfigError,
    EnvConfig,
    MLPModelInit,
    load_config,
    parse_loss,
)
from sluice.config.policy import policy_of_service, policy_view, services_of
from sluice.learner.dist import DistContext
from sluice.learner.objectives.env import EnvObjective, collate_segments, evaluate
from sluice.modeling.mlp import MLPPolicy, build_mlp_policy
from sluice.rollout_svc.env_service import MLPActor
from sluice.rollout_svc.envs.gym_runner import GymRunner
from sluice.trajectory import Trajectory

CLASSIC = ["rollout.kind=env", "model.kind=mlp", "learner.loss.type=ppo"]


def random_policy(seed: int):
    g = np.random.default_rng(seed)

    def act(obs):
        n = len(obs)
        return g.integers(0, 2, n), np.zeros((n, 2), np.float32), np.full(n, np.log(0.5), np.float32)

    return act


def test_runner_segments_keep_episodes_and_truncation_final_states():
    cfg = EnvConfig(num_envs=3, unroll_length=20, kwargs={"max_episode_steps": 6})
    runner = GymRunner(cfg, seed=1)
    act = random_policy(0)
    first = runner.unroll(act)
    second = runner.unroll(act)
    assert len(first) == 3 and runner.steps_taken == 2 * 3 * 20
    for seg in first + second:
        a = seg.arrays
        assert (
            a["obs"].shape == (21, 4)
            and a["actions"].shape == (20,)
            and a["behaviour_logits"].shape == (20, 2)
        )
        ended = a["terminated"] | a["truncated"]
        # a time limit of 6 steps: every episode ends within 6 steps of the previous end
        ends = np.flatnonzero(ended)
        assert len(ends) >= 20 // 6 and np.all(np.diff(ends) <= 6)
        # truncation keeps the state it was cut at, which is not the next (reset) observation
        trunc = np.flatnonzero(a["truncated"] & ~a["terminated"])
        assert a["final_index"].tolist() == trunc.tolist()
        for t, final in zip(a["final_index"], a["final_obs"]):
            assert not np.array_equal(final, a["obs"][t + 1])
            assert np.all(np.abs(a["obs"][t + 1]) <= 0.05)  # CartPole resets near 0
        assert np.all(a["episode_lengths"] <= 6)
        assert np.all(a["episode_returns"] == a["episode_lengths"])  # reward 1 per step
    runner.close()


def test_runner_episode_returns_cross_segment_boundaries():
    cfg = EnvConfig(num_envs=2, unroll_length=7, kwargs={"max_episode_steps": 10})
    runner = GymRunner(cfg, seed=3)
    segs = [runner.unroll(random_policy(1)) for _ in range(6)]
    for j in range(2):
        rewards = np.concatenate([s[j].arrays["rewards"] for s in segs])
        ended = np.concatenate([s[j].arrays["terminated"] | s[j].arrays["truncated"] for s in segs])
        returns = np.concatenate([s[j].arrays["episode_returns"] for s in segs])
        expect, run = [], 0.0
        for r, e in zip(rewards, ended):
            run += r
            if e:
                expect.append(run)
                run = 0.0
        assert returns.tolist() == expect


def test_mlp_policy_saves_loads_and_inits_like_ppo(tmp_path):
    model = build_mlp_policy(MLPModelInit(hidden_sizes=[32, 16], seed=4), obs_dim=4, n_actions=3)
    again = build_mlp_policy(MLPModelInit(hidden_sizes=[32, 16], seed=4), obs_dim=4, n_actions=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))  # seeded
    assert model.value_torso is not None  # actor and critic torsos are separate by default
    w = model.policy_head.weight
    assert torch.allclose(w @ w.T, 0.01**2 * torch.eye(3), atol=1e-6)  # orthogonal, gain 0.01
    model.save_pretrained(tmp_path)
    loaded = MLPPolicy.from_pretrained(tmp_path)
    x = torch.randn(5, 4)
    assert all(torch.equal(a, b) for a, b in zip(model(x), loaded(x)))
    shared = build_mlp_policy(MLPModelInit(shared_torso=True), 4, 2)
    assert shared.value_torso is None and shared(x)[1].shape == (5,)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="model_type"):
        MLPPolicy.from_pretrained(tmp_path)


def test_actor_samples_with_the_logprobs_it_reports():
    model = build_mlp_policy(MLPModelInit(), 4, 2)
    actor = MLPActor(model, seed=0)
    obs = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    actions, logits, logp = actor(obs)
    expect = torch.log_softmax(torch.from_numpy(logits), -1)[torch.arange(64), torch.from_numpy(actions)]
    assert np.allclose(logp, expect.numpy(), atol=1e-6)
    actor.load_weights([(n, torch.zeros_like(p)) for n, p in model.named_parameters()], version=3)
    assert actor.version == 3 and np.allclose(actor(obs)[2], np.log(0.5))  # uniform now


def segment(final_at: int | None) -> Trajectory:
    t_len = 4
    obs = np.arange((t_len + 1) * 4, dtype=np.float32).reshape(t_len + 1, 4) / 10
    trunc = np.zeros(t_len, bool)
    finals = np.zeros((0, 4), np.float32)
    if final_at is not None:
        trunc[final_at] = True
        finals = np.full((1, 4), 9.0, np.float32)
    return Trajectory(
        traj_id="s",
        group_id="g",
        version=0,
        arrays={
            "obs": obs,
            "actions": np.zeros(t_len, np.int64),
            "rewards": np.ones(t_len, np.float32),
            "terminated": np.zeros(t_len, bool),
            "truncated": trunc,
            "behaviour_logits": np.zeros((t_len, 2), np.float32),
            "behaviour_logprobs": np.full(t_len, np.log(0.5), np.float32),
            "final_index": np.asarray([] if final_at is None else [final_at], np.int32),
            "final_obs": finals,
            "episode_returns": np.zeros(0, np.float32),
            "episode_lengths": np.zeros(0, np.int32),
        },
    )


def test_env_objective_bootstraps_truncated_steps_from_their_final_state():
    model = build_mlp_policy(MLPModelInit(), 4, 2)
    seg = collate_segments([segment(None), segment(1)], torch.device("cpu"))
    with torch.no_grad():
        _, values, next_values, _ = evaluate(model, seg)
        v_obs = model(seg.obs)[1]
        v_final = model(torch.full((1, 4), 9.0))[1]
    assert torch.allclose(values, v_obs[:, :-1])
    assert torch.allclose(next_values[0], v_obs[0, 1:])  # no truncation: V(x_{t+1})
    assert torch.allclose(next_values[1, 1], v_final[0])  # truncated at step 1: V(final state)
    assert torch.allclose(next_values[1, [0, 2, 3]], v_obs[1, [1, 3, 4]])


@pytest.mark.parametrize("loss_type", ["ppo", "decoupled_ppo", "vtrace"])
def test_env_objective_pieces_cover_the_batch_and_sum_to_the_whole_loss(loss_type):
    torch.manual_seed(0)
    model = build_mlp_policy(MLPModelInit(), 4, 2)
    classic = ClassicObjectiveConfig(gamma=0.9, entropy_coef=0.01)
    obj = EnvObjective(parse_loss({"type": loss_type}), classic, 4, torch.device("cpu"))
    batch = obj.prepare(model, [segment(None), segment(2), segment(1)], DistContext())
    whole = obj.micro(batch, 1)
    pieces = obj.micro(batch, 2)
    from sluice.learner.losses.aggregate import Denominator

    tokens, seqs = obj.counts(whole[0])
    assert sum(obj.counts(p)[0] for p in pieces) == tokens == 12
    denom = Denominator(tokens, seqs)
    full, _ = obj.loss(model, whole[0], denom)
    parts = sum(obj.loss(model, p, denom)[0] for p in pieces)
    assert torch.allclose(full, parts, atol=1e-6)
    many = obj.micro(batch, 20)  # more pieces than rows: the extra ones are zero-weight dummies
    assert len(many) == 20 and sum(obj.counts(p)[0] for p in many) == tokens
    assert torch.allclose(sum(obj.loss(model, p, denom)[0] for p in many), full, atol=1e-6)


def test_config_kinds_must_agree():
    with pytest.raises(ConfigError, match="rollout.kind=env needs model.kind=mlp"):
        load_config(None, ["rollout.kind=env"])
    with pytest.raises(ConfigError, match="vtrace is for classic RL"):
        load_config(None, ["learner.loss.type=vtrace"])
    with pytest.raises(ConfigError, match="several policies with rollout.kind=llm need a multi-agent task"):
        load_config(None, ["learner.policies=[a, b]"])
    # trained leases held for a checkpoint do not count against the capacity producers see
    load_config(None, ["learner.checkpoint_every=10", "buffer.capacity=1000"])
    with pytest.raises(ConfigError, match="policy ids must be unique"):
        load_config(None, [*CLASSIC, "learner.policies=[a, a]"])


def test_policy_groups_get_their_services_and_ports():
    cfg = load_config(
        None,
        [
            *CLASSIC,
            "rollout.services=5",
            "learner.policies=[red, blue]",
            "control.port=1000",
            "weight_sync.master_port=2000",
            "learner.master_port=3000",
            "learner.group_ports={blue: {control: 1001, weight_sync: 2001, dist: 3001}}",
        ],
    )
    assert services_of(cfg, "red") == [0, 2, 4] and services_of(cfg, "blue") == [1, 3]
    assert policy_of_service(cfg, 3) == ("blue", 1)
    assert policy_view(cfg, "red") is cfg
    blue = policy_view(cfg, "blue")
    assert (blue.control.port, blue.weight_sync.master_port, blue.learner.master_port) == (1001, 2001, 3001)
    missing = load_config(None, [*CLASSIC, "learner.policies=[red, blue]"])
    with pytest.raises(ValueError, match="group_ports.blue"):
        policy_view(missing, "blue")
