"""Multi-agent LLM training, in-process: the two shipped tasks' rules, the opponent pool, the
config checks, and the multi-agent producer with real HF engines (one per policy), which must
route each agent's turns to its own policy with its own version tags and groups."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from sluice.config.loader import ConfigError, load_config
from sluice.config.task import OpponentPoolConfig
from sluice.launch.plan import plan_roles
from sluice.modeling import materialize_model_dir
from sluice.plugins import UserCodeError
from sluice.rollout_svc.agents import MultiAgentProducer
from sluice.rollout_svc.engines.base import WeightUpdate
from sluice.rollout_svc.engines.sim import SimEngine
from sluice.rollout_svc.opponents import OpponentPool
from sluice.rollout_svc.tasks.duel import DuelConfig, DuelMatch, DuelTask
from sluice.rollout_svc.tasks.propose_solve import ProposeSolveMatch

ROOT = Path(__file__).resolve().parents[1]
PROPOSE = ROOT / "configs" / "multi_agent" / "propose_solve.yaml"
DUEL = ROOT / "configs" / "multi_agent" / "duel.yaml"
SMALL = ["rollout.prompts_per_batch=2", "rollout.group_size=4"]


def test_propose_solve_credits_the_problem_and_the_answer():
    match = ProposeSolveMatch("3", 2, shared=False)
    assert match.observe("proposer") == "3 ="
    match.act("proposer", " 3 8 ", True)
    assert match.observe("solver") == "3 8 ="  # the solver sees the problem only
    match.act("solver", "3 8", True)
    rewards = match.rewards()
    assert rewards["proposer"].reward == rewards["solver"].reward == 1.0
    assert rewards["solver"].info == {"valid": 1.0, "exact": 1.0, "team": 1.0}
    wrong_start = ProposeSolveMatch("3", 2, shared=False)
    wrong_start.act("proposer", "5 8", True)  # well formed, wrong first digit: half the problem's credit
    wrong_start.act("solver", "5 9", False)  # one digit right, not stopped: a third of the answer's
    rewards = wrong_start.rewards()
    assert rewards["proposer"].reward == pytest.approx(0.5 / 2)  # the answer counts on valid problems only
    assert rewards["solver"].reward == pytest.approx(1 / 3)  # split: its own credit, the problem well formed
    malformed = ProposeSolveMatch("3", 2, shared=False)
    malformed.act("proposer", "3", True)  # too short: nothing to solve
    malformed.act("solver", "3", True)  # a perfect copy of it earns the solver nothing
    assert malformed.rewards()["solver"].reward == 0.0 and malformed.rewards()["proposer"].reward == 0.25


def test_propose_solve_shared_credit_gives_both_the_team_reward():
    match = ProposeSolveMatch("3", 2, shared=True)
    match.act("proposer", "3", True)  # too short: no answer credit
    match.act("solver", "3", True)
    rewards = match.rewards()
    assert rewards["proposer"].reward == rewards["solver"].reward == pytest.approx(0.25)
    empty = ProposeSolveMatch("3", 2, shared=False)
    empty.act("proposer", "", True)
    empty.act("solver", "", True)  # nothing to copy is not a solved problem
    assert empty.rewards()["solver"].reward == 0.0


@pytest.mark.parametrize(
    ("first", "second", "expected"),
    [("9", "4", 1.0), ("4", "9", 0.0), ("4", "4", 0.5), ("4", "7 7", 1.0), ("5", "4", 0.0), ("x", "", 0.5)],
)
def test_duel_legal_plays_beat_illegal_ones_and_higher_beats_lower(first, second, expected):
    match = DuelMatch({"first": ["4", "9", "2"], "second": ["4", "9", "7"]})
    assert match.observe("first") == "4 9 2 ="
    match.act("first", first, True)
    match.act("second", second, True)
    rewards = match.rewards()
    assert rewards["first"].reward == expected and rewards["first"].reward + rewards["second"].reward == 1.0


def test_a_duel_play_cut_at_its_budget_is_illegal():
    match = DuelMatch({"first": ["4"], "second": ["2"]})
    match.act("first", "4", False)
    match.act("second", "2", True)
    assert match.rewards()["first"].reward == 0.0 and match.rewards()["first"].info["legal"] == 0.0
    task = DuelTask(DuelConfig(hand=2), seed=1)
    prompts = task.sample(3)
    assert len({p.prompt_id for p in prompts}) == 3 and all(len(p.reference["first"]) == 2 for p in prompts)


def test_the_opponent_pool_keeps_version_0_and_the_newest_kth_versions():
    engine = SimEngine(
        [str(d) for d in range(10)], 32, load_config(None, ["rollout.engine=sim"]).rollout.sim, 0
    )
    pool = OpponentPool(OpponentPoolConfig(every=5, size=2, latest=0.0), engine, seed=0)
    source = torch.ones(3)
    for v in range(0, 21):
        pool.offer(WeightUpdate(v, [("w", source * v)]))
    assert list(pool.kept) == [0, 15, 20]
    source.zero_()  # the pool's copies outlive the receive buffer
    assert float(pool.kept[20][0][1][0]) == 20.0
    drawn = {pool.draw() for _ in range(60)}
    assert drawn == {0, 15, 20} and engine.version in drawn
    always_current = OpponentPool(OpponentPoolConfig(latest=1.0), engine, seed=0)
    always_current.offer(WeightUpdate(0, []))
    assert always_current.draw() is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["task.agents.solver.policy=nobody"],
            "task.agents.solver.policy: 'nobody' is not in learner.policies",
        ),
        (["task.agents.solver.policy=proposer"], r"\['solver'\] trained by no agent"),
        (["task.eval.every=5"], "matches give the rewards"),
        (["task.agents={}"], "several policies with rollout.kind=llm need a multi-agent task"),
    ],
)
def test_multi_agent_configs_are_checked_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(PROPOSE, overrides)


def producer(tmp_path: Path, path: Path, *overrides: str) -> MultiAgentProducer:
    cfg = load_config(path, [f"run.dir={tmp_path}", *SMALL, *overrides])
    return MultiAgentProducer(cfg, 0, CollectorRegistry())


def weights(tmp_path: Path, path: Path, version: int) -> WeightUpdate:
    from safetensors.torch import load_file

    cfg = load_config(path, [f"run.dir={tmp_path}"])
    state = load_file(materialize_model_dir(cfg.model, cfg.run_dir) / "model.safetensors")
    return WeightUpdate(version, list(state.items()))


def test_a_pool_of_checkpoints_reads_the_policys_saved_versions_from_disk(tmp_path):
    """source: checkpoints: the pool is the policy's finished step_<v> directories (every k-th,
    the newest `size`) and the initial model as version 0, listed at each draw and read when
    drawn; a pool made anew (a restarted service) finds the same versions."""
    from safetensors.torch import save_file

    from sluice.rollout_svc.opponents import checkpoint_versions, read_weights

    initial, root = tmp_path / "model", tmp_path / "checkpoints"
    for d, scale in ((initial, 0), *((root / f"step_{v:06d}", v) for v in (5, 10, 15, 20))):
        d.mkdir(parents=True)
        save_file({"w": torch.full((3,), float(scale))}, str(d / "model.safetensors"))
    (root / ".step_000025.tmp").mkdir()  # being written: not a checkpoint yet
    (root / "step_000030").mkdir()  # no weights in it (yet): not one either
    assert sorted(checkpoint_versions(root, initial)) == [0, 5, 10, 15, 20]
    assert float(read_weights(root / "step_000010")[0][1][0]) == 10.0
    engine = SimEngine(
        [str(d) for d in range(10)], 32, load_config(None, ["rollout.engine=sim"]).rollout.sim, 0
    )
    cfg = OpponentPoolConfig(every=10, size=1, latest=0.0, source="checkpoints")
    pool = OpponentPool(cfg, engine, seed=0, checkpoints=(root, initial))
    pool.offer(WeightUpdate(40, [("w", torch.ones(3))]))  # received versions are not kept
    assert {pool.draw() for _ in range(40)} == {0, 20} and list(pool.kept) == [0, 20]
    save_file({"w": torch.full((3,), 30.0)}, str(root / "step_000030" / "model.safetensors"))
    again = OpponentPool(cfg, engine, seed=1, checkpoints=(root, initial))
    assert {again.draw() for _ in range(40)} == {0, 30}  # the newest, found at the next draw
    with pytest.raises(ValueError, match="needs their directory"):
        OpponentPool(cfg, engine, seed=0)


def test_each_agents_turns_go_to_its_own_policy_with_its_own_versions_and_groups(tmp_path):
    p = producer(tmp_path, PROPOSE)
    try:
        p.load_weights("proposer", weights(tmp_path, PROPOSE, 3))
        p.load_weights("solver", weights(tmp_path, PROPOSE, 5))
        assert p.request() == {"proposer": (8, 4), "solver": (8, 4)}
        produced = p.produce({"proposer": 8, "solver": 4}, {})  # the smaller grant decides: 1 prompt
        assert produced is not None
        by_policy = {
            q: [t for t in produced.trajectories if t.policy_id == q] for q in ("proposer", "solver")
        }
        assert [len(ts) for ts in by_policy.values()] == [4, 4]
        for policy, version in (("proposer", 3), ("solver", 5)):
            ts = by_policy[policy]
            assert {t.group_id for t in ts} == {f"{p.group_prefix}/propose_solve1/{policy}"} and {
                t.group_size for t in ts
            } == {4}
            assert all(t.version == version and set(t.arrays["token_versions"]) <= {version} for t in ts)
        tok = p.tokenizer
        for prop, solv in zip(by_policy["proposer"], by_policy["solver"]):  # match j of each group
            problem = tok.decode(prop.arrays["completion_ids"].tolist(), skip_special_tokens=True).split()
            seen = tok.decode(solv.arrays["prompt_ids"].tolist(), skip_special_tokens=True)
            assert seen.split() == [*problem, "="]  # the solver's prompt is the proposer's problem
            assert prop.info["team"] == solv.info["team"] == prop.reward  # the proposer's is the team's
        assert produced.record["matches"] == 4 and "reward/solver" in produced.record
    finally:
        p.close()


def test_a_pool_opponent_acts_with_a_past_version_and_its_turns_are_not_trained(tmp_path):
    pool = ("task.agents.second.opponent_pool.every=2", "task.agents.second.opponent_pool.source=received")
    p = producer(tmp_path, DUEL, *pool)
    try:
        for v in range(5):
            p.load_weights("player", weights(tmp_path, DUEL, v))
        assert list(p.pools["second"].kept) == [0, 2, 4] and p.request() == {"player": (8, 4)}
        seen = set()
        for _ in range(6):
            produced = p.produce({"player": 8}, {})
            assert produced is not None
            assert {t.policy_id for t in produced.trajectories} == {"player"} and len(
                produced.trajectories
            ) == 8
            assert all("/first/" in t.traj_id and t.version == 4 for t in produced.trajectories)
            seen.add(produced.record["opponent_version/second"])
            assert produced.record["reward/first"] + produced.record["reward/second"] == pytest.approx(1.0)
        assert seen <= {0, 2, 4, None} and len(seen) > 1
    finally:
        p.close()


def test_self_play_in_both_seats_trains_on_both_seats(tmp_path):
    p = producer(tmp_path, DUEL, "task.agents.second.opponent_pool=null")
    try:
        p.load_weights("player", weights(tmp_path, DUEL, 1))
        assert p.request() == {"player": (16, 4)}
        produced = p.produce({"player": 16}, {})
        assert produced is not None and len(produced.trajectories) == 16
        assert len({t.group_id for t in produced.trajectories}) == 4  # 2 prompts x 2 seats
        assert len({t.traj_id for t in produced.trajectories}) == 16
    finally:
        p.close()


class RaisingMatch(ProposeSolveMatch):
    def rewards(self):
        raise ZeroDivisionError("the user's scoring")


def test_a_match_that_raises_stops_the_service_as_the_users_error(tmp_path, monkeypatch):
    p = producer(tmp_path, PROPOSE)
    try:
        for policy in ("proposer", "solver"):
            p.load_weights(policy, weights(tmp_path, PROPOSE, 0))
        monkeypatch.setattr(p.task, "start", lambda prompt: RaisingMatch(prompt.reference, 2, shared=True))
        with pytest.raises(UserCodeError, match="task 'propose_solve'.*rewards.*ZeroDivisionError"):
            p.produce({"proposer": 4, "solver": 4}, {})
    finally:
        p.close()


def test_agent_names_must_be_the_tasks(tmp_path):
    with pytest.raises(ConfigError, match=r"task 'propose_solve' has agents \['proposer', 'solver'\]"):
        producer(tmp_path, PROPOSE, "task.agents={a: {policy: proposer}, b: {policy: solver}}")


def test_every_rollout_service_serves_every_policy_and_restarts_with_each_group():
    cfg = load_config(PROPOSE, ["rollout.services=2"])
    rollouts = [r for r in plan_roles(cfg) if r.kind == "rollout"]
    assert [r.served for r in rollouts] == [("proposer", "solver")] * 2
    assert all(r.belongs_to("proposer") and r.belongs_to("solver") for r in rollouts)
    learners = [r for r in plan_roles(cfg) if r.kind == "learner"]
    assert [(r.name, r.policy) for r in learners] == [("learner", "proposer"), ("learner-solver", "solver")]
    assert not learners[0].belongs_to("solver")
    assert np.all([r.exits_with_run for r in rollouts])
