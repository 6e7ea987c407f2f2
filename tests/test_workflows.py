"""Algorithms as workflow files: every shipped workflow loads and trains, the field contract is
checked at load, GRPO and PPO-with-critic match losses computed by hand, a user's stage by file
reference runs and is held to what it declares (docs/workflows.md)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers.runs import ROOT
from helpers.workflows import ENV_WORKFLOWS, LLM_WORKFLOWS, cartpole_with

from sluice.config import ConfigError, load_config
from sluice.config.workflow_check import effective_workflow, shipped_workflows
from sluice.learner.dist import DistContext
from sluice.learner.losses.aggregate import Denominator
from sluice.learner.stages.advantages import batch_whitened, rloo_advantages
from sluice.trajectory import Trajectory

QUICKSTART = ROOT / "configs" / "quickstart.yaml"
TINY = ["model.init.hidden_size=16", "model.init.intermediate_size=32", "model.init.num_layers=1"]


def test_every_shipped_workflow_is_tested_and_loads(tmp_path):
    assert shipped_workflows() == sorted(LLM_WORKFLOWS + ENV_WORKFLOWS)
    for name in LLM_WORKFLOWS:
        wf = load_config(QUICKSTART, [f"workflow={name}"]).workflow
        assert wf is not None and wf.name == name and wf.description
    for name in ENV_WORKFLOWS:
        wf = load_config(cartpole_with(name, tmp_path)).workflow
        assert wf is not None and wf.learner[0].stage == "actor_critic"


def test_the_quickstart_names_its_workflow_and_switching_touches_only_that_key():
    assert yaml.safe_load(QUICKSTART.read_text())["workflow"] == "grpo"
    base = load_config(QUICKSTART).model_dump()
    for name in ("rloo", "gspo"):
        other = load_config(QUICKSTART, [f"workflow={name}"]).model_dump()
        assert {k for k in base if base[k] != other[k]} == {"workflow"}


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        (
            "[{stage: policy_loss}]",
            "workflow.learner[0] (policy_loss) reads 'advantages', which no earlier stage writes",
        ),
        (
            "[{stage: group_advantages}, {stage: kl_penalty}, {stage: policy_loss}]",
            "workflow.learner[1] (kl_penalty) reads 'ref_logprobs', which no earlier stage writes",
        ),
        (
            "[{stage: group_advantages}, {stage: policy_loss}, {stage: proximal_logprobs}]",
            "workflow.learner[2] (proximal_logprobs): a prepare stage after a loss stage",
        ),
        ("[{stage: group_advantages}]", "workflow.learner: no loss stage"),
        (
            "[{stage: a.b:c, phase: prepare, reads: [values], writes: [advantages]}, {stage: policy_loss}]",
            "workflow.learner[0] (a.b:c) reads 'values', which no earlier stage writes",
        ),
    ],
)
def test_a_workflow_that_reads_an_unwritten_field_fails_at_load_naming_stage_and_field(stages, message):
    with pytest.raises(ConfigError) as e:
        load_config(QUICKSTART, [f"workflow={{name: bad, learner: {stages}}}"])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_field_written_later_is_named_and_legacy_keys_clash_with_a_workflow():
    with pytest.raises(ConfigError, match=r"workflow.learner\[2\] \(proximal_logprobs\) writes it, later"):
        load_config(
            QUICKSTART,
            ["workflow={learner: [{stage: group_advantages}, {stage: policy_loss, loss: {type: gspo, "
             "recompute_proximal: true}}, {stage: proximal_logprobs}]}"],
        )  # fmt: skip
    with pytest.raises(ConfigError, match="learner.loss: set by the workflow"):
        load_config(QUICKSTART, ["learner.loss.type=ppo"])
    with pytest.raises(ConfigError, match="actor_critic is for classic RL"):
        load_config(QUICKSTART, ["workflow=vtrace"])
    with pytest.raises(ConfigError, match="neither a shipped workflow"):
        load_config(QUICKSTART, ["workflow=nope"])
    cfg = load_config(QUICKSTART, ["workflow=dapo", "workflow.learner.2.loss.clip_high=0.3"])
    assert cfg.workflow is not None and cfg.workflow.learner[2].loss.clip_high == 0.3


def test_without_a_workflow_the_legacy_keys_mean_the_same_stages():
    cfg = load_config(
        QUICKSTART, ["workflow=null", "learner.loss.type=decoupled_ppo", "learner.llm.kl_coef=0.1"]
    )
    stages = [s.stage for s in effective_workflow(cfg).learner]
    assert stages == [
        "proximal_logprobs",
        "reference_logprobs",
        "group_advantages",
        "policy_loss",
        "kl_penalty",
    ]
    grpo = effective_workflow(load_config(QUICKSTART, ["workflow=null"]))
    assert grpo.learner == load_config(QUICKSTART).workflow.learner  # type: ignore[union-attr]


# -- advantages and losses by hand -------------------------------------------------------------


def test_rloo_and_batch_whitened_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.5, 2.0, 4.0, 7.0])
    g = torch.tensor([0, 0, 0, 1, 1, 2])
    expected = [
        1 - 0.25,
        0 - 0.75,
        0.5 - 0.5,
        2 - 4,
        4 - 2,
        0.0,
    ]  # the other samples' mean; a group of one: 0
    assert torch.allclose(rloo_advantages(r, g), torch.tensor(expected))
    mean = r.mean()
    std = ((r - mean) ** 2).mean().sqrt()
    assert torch.allclose(batch_whitened(r, 6, DistContext(), 1e-8), (r - mean) / (std + 1e-8), atol=1e-6)


def llm_batch() -> list[Trajectory]:
    lengths, rewards = [3, 1, 4, 2, 2, 5], [1.0, 0.0, 0.0, 1.0, 0.5, 0.0]
    return [
        Trajectory(
            traj_id=f"t{i}",
            group_id=f"g{i // 3}",
            version=0,
            group_size=3,
            reward=rewards[i],
            arrays={
                "prompt_ids": np.asarray([0, 3, 4], np.int32),
                "completion_ids": (np.arange(n, dtype=np.int32) + i) % 10 + 3,
                "behaviour_logprobs": np.linspace(-2.5, -1.5, n).astype(np.float32),
            },
        )
        for i, n in enumerate(lengths)
    ]


def token_objective(tmp_path: Path, overrides: list[str]):
    from sluice.learner.objectives.token import TokenObjective
    from sluice.modeling import load_policy
    from sluice.modeling.policy import materialize_policy_dir
    from sluice.modeling.sampling import SamplingTransform

    cfg = load_config(QUICKSTART, [f"run.dir={tmp_path}", *TINY, *overrides])
    model_dir = materialize_policy_dir(cfg)
    model, tok = load_policy(model_dir)
    stages = effective_workflow(cfg).learner
    obj = TokenObjective(
        stages, tok.pad_token_id, tok.bos_token_id, SamplingTransform(), torch.device("cpu"), model_dir
    )
    return obj, model


def test_grpo_from_its_workflow_file_matches_the_loss_by_hand(tmp_path):
    from sluice.learner.batch import collate, token_logprobs
    from sluice.modeling.sampling import SamplingTransform

    obj, model = token_objective(tmp_path, ["workflow=grpo"])
    trajs = llm_batch()
    piece = obj.prepare(model, trajs, DistContext())
    tokens, seqs = obj.counts(piece)
    loss, stats = obj.loss(model, piece, Denominator(tokens, seqs))

    batch = collate(trajs, obj.pad_id)
    logp = token_logprobs(model, batch, SamplingTransform()).detach()
    total, n = 0.0, 0
    for i, t in enumerate(trajs):
        group = [u.reward for u in trajs if u.group_id == t.group_id]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
        adv = (t.reward - mean) / (std + 1e-4)
        start = len(t.arrays["prompt_ids"]) - 1  # target j predicts token j + 1
        for k, mu in enumerate(t.arrays["behaviour_logprobs"]):
            lp = logp[i, start + k]
            w = min(math.exp(float(lp) - float(mu)), 2.0)  # truncated IS, detached
            total += -w * adv * lp
            n += 1
    assert n == tokens
    assert torch.allclose(loss, total / n, atol=1e-6)
    assert torch.allclose(stats["policy_loss"], total / n, atol=1e-6)


def test_an_entropy_bonus_adds_minus_coef_times_the_token_entropy(tmp_path):
    """entropy_bonus: loss = policy loss - coef x the mean over trained tokens of the entropy of
    softmax(logits) at that position, from the loss forward, with a gradient of its own."""
    from sluice.learner.batch import collate

    grpo = yaml.safe_load((ROOT / "configs" / "algorithms" / "grpo.yaml").read_text())
    grpo["learner"].append({"stage": "entropy_bonus", "coef": 0.05})
    (tmp_path / "grpo_entropy.yaml").write_text(yaml.safe_dump(grpo))
    obj, model = token_objective(tmp_path, [f"workflow={tmp_path / 'grpo_entropy.yaml'}"])
    plain, _ = token_objective(tmp_path, ["workflow=grpo"])
    trajs = llm_batch()
    piece = obj.prepare(model, trajs, DistContext())
    denom = Denominator(*obj.counts(piece))
    loss, stats = obj.loss(model, piece, denom)

    batch = collate(trajs, obj.pad_id)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    logp = torch.log_softmax(logits.double(), -1)
    expected = float((-(logp.exp() * logp).sum(-1))[batch.completion_mask.bool()].mean())
    assert float(stats["entropy"]) == pytest.approx(expected, rel=1e-5)
    assert float(stats["entropy_bonus"]) == pytest.approx(-expected, rel=1e-5)
    assert float(loss.detach()) == pytest.approx(float(stats["policy_loss"]) - 0.05 * expected, rel=1e-5)
    plain_loss = plain.loss(model, plain.prepare(model, trajs, DistContext()), denom)[0]
    grads = []
    for total in (loss, plain_loss):
        model.zero_grad()
        total.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert (grads[0] - grads[1]).abs().max() > 1e-6  # the bonus moves the weights too
    assert "entropy" not in plain.loss(model, piece, denom)[1]  # computed only when a stage reads it


def test_llm_ppo_with_a_critic_from_its_workflow_file_matches_the_loss_by_hand(tmp_path):
    from sluice.learner.batch import collate, token_logprobs
    from sluice.modeling.sampling import SamplingTransform

    obj, model = token_objective(tmp_path, ["workflow=ppo_critic"])
    assert obj.critic is not None
    torch.manual_seed(0)
    with torch.no_grad():  # a critic that is not all zeros, so GAE has values to work with
        obj.critic.head.weight.normal_(0, 0.5)
        obj.critic.head.bias.fill_(0.1)
    trajs = llm_batch()
    piece = obj.prepare(model, trajs, DistContext())
    tokens, seqs = obj.counts(piece)
    loss, stats = obj.loss(model, piece, Denominator(tokens, seqs))

    batch = collate(trajs, obj.pad_id)
    with torch.no_grad():
        values = obj.critic.values(batch)
        logp = token_logprobs(model, batch, SamplingTransform())
    positions = [
        range(
            len(t.arrays["prompt_ids"]) - 1, len(t.arrays["prompt_ids"]) - 1 + len(t.arrays["completion_ids"])
        )
        for t in trajs
    ]
    adv, ret = {}, {}
    for i, t in enumerate(trajs):  # GAE(gamma 1, lambda 0.95); reward on the last token, then V = 0
        running, next_v = 0.0, 0.0
        for j in reversed(positions[i]):
            v = float(values[i, j])
            delta = (t.reward if j == positions[i][-1] else 0.0) + next_v - v
            running = delta + 0.95 * running
            adv[i, j], ret[i, j], next_v = running, running + v, v
    a = torch.tensor(list(adv.values()), dtype=torch.float64)
    white = dict(zip(adv, ((a - a.mean()) / (((a - a.mean()) ** 2).mean().sqrt() + 1e-8)).tolist()))
    policy = value = 0.0
    for (i, j), a_ij in white.items():
        ratio = math.exp(
            float(logp[i, j]) - float(trajs[i].arrays["behaviour_logprobs"][j - positions[i][0]])
        )
        policy += -min(ratio * a_ij, min(max(ratio, 0.8), 1.2) * a_ij)
        value += 0.5 * (float(values[i, j]) - ret[i, j]) ** 2
    assert len(white) == tokens
    assert stats["policy_loss"] == pytest.approx(policy / tokens, abs=1e-5)
    assert stats["value_loss"] == pytest.approx(value / tokens, abs=1e-5)
    assert float(loss.detach()) == pytest.approx(policy / tokens + 0.5 * value / tokens, abs=1e-5)
    loss.backward()
    assert obj.critic.head.weight.grad is not None and obj.critic.head.weight.grad.abs().sum() > 0


def test_the_critic_trains_and_resumes_from_a_checkpoint(tmp_path):
    from sluice.learner.checkpoint import save_checkpoint
    from sluice.learner.trainer import Trainer
    from sluice.modeling.policy import materialize_policy_dir

    cfg = load_config(
        QUICKSTART, [f"run.dir={tmp_path}", *TINY, "workflow=ppo_critic", "learner.batch_size=6"]
    )
    model_dir = materialize_policy_dir(cfg)
    trainer = Trainer(cfg, DistContext(), model_dir)
    stats = trainer.train_step(llm_batch())
    assert stats["critic_grad_norm"] > 0 and stats["value_loss"] > 0
    critic = trainer.objective.critic  # type: ignore[attr-defined]
    assert critic.head.weight.abs().sum() > 0  # the zero head has moved
    ckpt = save_checkpoint(tmp_path / "ckpt", 1, trainer, DistContext(), {}, keep=1)
    assert (ckpt / "critic.pt").is_file()
    resumed = Trainer(cfg, DistContext(), model_dir, resume_dir=ckpt)
    for a, b in zip(critic.state_dict().values(), resumed.objective.critic.state_dict().values()):  # type: ignore[attr-defined]
        assert torch.equal(a, b)


def test_dapo_does_not_train_on_a_completion_cut_at_the_token_budget(tmp_path):
    obj, model = token_objective(tmp_path, ["workflow=dapo"])
    trajs = llm_batch()
    trajs[2].info["truncated"] = True  # 4 tokens, as the rollout marks a sample it cut
    piece = obj.prepare(model, trajs, DistContext())
    assert obj.counts(piece) == (17 - 4, 6)
    assert not piece.fields["mask"][2].any() and piece.fields["mask"][3].any()
    assert piece.fields["advantages"][2] != 0  # its group's advantages are computed as before


def test_gspo_uses_the_sequence_ratio(tmp_path):
    obj, model = token_objective(tmp_path, ["workflow=gspo"])
    piece = obj.prepare(model, llm_batch(), DistContext())
    loss, stats = obj.loss(model, piece, Denominator(*obj.counts(piece)))
    # pi_old is the proximal policy, the same weights: every sequence ratio is exactly 1
    assert torch.allclose(stats["seq_ratio_mean"], torch.tensor(1.0)) and stats["seq_clip_frac"] == 0
    adv = piece.fields["advantages"]
    assert torch.allclose(loss, -adv.mean(), atol=1e-6)  # -(1/G) sum_i s_i A_i with s_i = 1


def segment(seed: int) -> Trajectory:
    g = np.random.default_rng(seed)
    t_len = 5
    return Trajectory(
        traj_id=f"s{seed}",
        group_id=f"g{seed}",
        version=0,
        arrays={
            "obs": g.normal(size=(t_len + 1, 4)).astype(np.float32),
            "actions": g.integers(0, 2, t_len).astype(np.int64),
            "rewards": g.normal(size=t_len).astype(np.float32),
            "terminated": np.zeros(t_len, bool),
            "truncated": np.zeros(t_len, bool),
            "behaviour_logits": np.zeros((t_len, 2), np.float32),
            "behaviour_logprobs": np.full(t_len, np.log(0.4), np.float32),
            "final_index": np.zeros(0, np.int32),
            "final_obs": np.zeros((0, 4), np.float32),
            "episode_returns": np.zeros(0, np.float32),
        },
    )


def test_ppo_with_a_critic_from_its_workflow_file_matches_the_loss_by_hand(tmp_path):
    from sluice.config.workflow import ActorCritic
    from sluice.learner.objectives.env import EnvObjective
    from sluice.modeling.mlp import build_mlp_policy

    cfg = load_config(cartpole_with("ppo_gae", tmp_path))
    (stage,) = effective_workflow(cfg).learner
    assert isinstance(stage, ActorCritic)
    torch.manual_seed(0)
    model = build_mlp_policy(cfg.model.mlp, 4, 2)
    obj = EnvObjective(stage.loss, stage.classic, 4, torch.device("cpu"))
    segs = [segment(0), segment(1)]
    (piece,) = obj.micro(obj.prepare(model, segs, DistContext()), 1)
    loss, _ = obj.loss(model, piece, Denominator(*obj.counts(piece)))

    c = stage.classic
    with torch.no_grad():
        values = [model(torch.from_numpy(s.arrays["obs"]))[1] for s in segs]
    advs, rets = [], []
    for s, v in zip(segs, values):
        a, running = [0.0] * 5, 0.0
        for t in reversed(range(5)):  # no episode ends inside: bootstrap from V(obs[t + 1])
            delta = float(s.arrays["rewards"][t]) + c.gamma * float(v[t + 1]) - float(v[t])
            running = delta + c.gamma * c.gae_lambda * running
            a[t] = running
        advs += a
        rets += [a[t] + float(v[t]) for t in range(5)]
    adv = torch.tensor(advs, dtype=torch.float64)
    adv = ((adv - adv.mean()) / (((adv - adv.mean()) ** 2).mean().sqrt() + 1e-8)).float()
    obs = torch.cat([torch.from_numpy(s.arrays["obs"][:-1]) for s in segs])
    actions = torch.cat([torch.from_numpy(s.arrays["actions"]) for s in segs])
    logits, v_now = model(obs)
    logp_all = torch.log_softmax(logits, -1)
    ratio = torch.exp(logp_all.gather(-1, actions[:, None]).squeeze(-1) - math.log(0.4))
    clipped = ratio.clamp(1 - stage.loss.clip_low, 1 + stage.loss.clip_high)  # type: ignore[union-attr]
    policy = -torch.min(ratio * adv, clipped * adv).mean()
    value = 0.5 * ((v_now - torch.tensor(rets)) ** 2).mean()
    entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
    expected = policy + c.value_coef * value - c.entropy_coef * entropy
    assert torch.allclose(loss, expected, atol=1e-5)


# -- every shipped workflow trains ---------------------------------------------------------------


@pytest.mark.parametrize("name", LLM_WORKFLOWS)
def test_every_llm_workflow_trains_a_few_steps(tmp_path, name):
    from sluice.learner.trainer import Trainer
    from sluice.modeling.policy import materialize_policy_dir

    cfg = load_config(QUICKSTART, [f"run.dir={tmp_path}", *TINY, f"workflow={name}", "learner.batch_size=6"])
    model_dir = materialize_policy_dir(cfg)
    trainer = Trainer(cfg, DistContext(), model_dir)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    for step in range(3):
        stats = trainer.train_step(llm_batch())
        assert all(math.isfinite(float(v)) for v in stats.values()), (step, stats)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


USER_STAGES = '''
import torch
from sluice.config.base import Section
from sluice.learner.losses.base import LossOutput


class Params(Section):
    bar: float = 0.5


def above_bar(fields, ctx, params):
    """Advantage: how far the reward is above a fixed bar."""
    return {"advantages": fields["rewards"] - params.bar}


above_bar.Params = Params


def wrong_fields(fields, ctx, params):
    return {"advantage": fields["rewards"]}


def length_penalty(fields, ctx, params):
    """The share of trained tokens in this piece (a term that has no gradient)."""
    return LossOutput(fields["mask"].sum() / ctx.denom.tokens + 0 * fields["logprobs"].sum())
'''


def test_a_user_stage_by_file_reference_runs_and_is_held_to_its_declared_fields(tmp_path):
    from sluice.learner.trainer import Trainer
    from sluice.modeling.policy import materialize_policy_dir

    path = tmp_path / "my_stages.py"
    path.write_text(USER_STAGES)

    def run(*stages: dict):
        wf = tmp_path / "mine.yaml"
        wf.write_text(yaml.safe_dump({"name": "mine", "learner": [*stages]}))
        cfg = load_config(
            QUICKSTART, [f"run.dir={tmp_path}", *TINY, "learner.batch_size=6", f"workflow={wf}"]
        )
        trainer = Trainer(cfg, DistContext(), materialize_policy_dir(cfg))
        return trainer.train_step(llm_batch())

    def mine(fn: str, **entry) -> dict:
        return {"stage": f"{path}:{fn}", **entry}

    adv = {"phase": "prepare", "reads": ["rewards"], "writes": ["advantages"]}
    stats = run(
        mine("above_bar", **adv, params={"bar": 0.25}),
        {"stage": "policy_loss"},
        mine("length_penalty", phase="loss", reads=["mask"], coef=0.0),
    )
    assert math.isfinite(stats["policy_loss"]) and stats["length_penalty"] == pytest.approx(1.0)
    with pytest.raises(ConfigError, match=r"workflow.learner.0.params.bar: Input should be a valid number"):
        run(mine("above_bar", **adv, params={"bar": "x"}), {"stage": "policy_loss"})
    with pytest.raises(TypeError, match=r"returned fields \['advantage'\]; its workflow entry declares"):
        run(mine("wrong_fields", **adv), {"stage": "policy_loss"})


def test_the_workflow_benchmark_summary_by_hand(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import workflows as bench

    assert bench.LLM_WORKFLOWS == LLM_WORKFLOWS
    run = {"rewards": [0.0, 0.2, 0.6, 0.9, 1.0, 1.0], "wall_s": 3.0}
    s = bench.summarise(run, window=2, threshold=0.8)
    # moving means of 2: -, 0.1, 0.4, 0.75, 0.95, 1.0 -> first >= 0.8 at step 5
    assert s == {
        "start": pytest.approx(0.1),
        "end": pytest.approx(1.0),
        "steps_to_threshold": 5,
        "wall_s": 3.0,
    }
    never = bench.summarise({"rewards": [0.1] * 4, "wall_s": 1.0}, window=2, threshold=0.8)
    assert never["steps_to_threshold"] is None
    _, rows = bench.table({"grpo": [s], "rloo": [never]}, steps=6)
    assert rows["grpo"]["steps_vs_grpo"] == 1.0 and rows["rloo"]["steps_vs_grpo"] is None  # never reached
