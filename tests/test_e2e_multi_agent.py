"""The two shipped multi-agent tasks under `sluice run` (real processes, real ZeroMQ): one
rollout service hosting every policy, a learner group per policy. Each policy's learner trains
only its own agents' turns, each exactly once, within its own staleness bound; the self-play
opponent acts with past versions and is never trained (docs/multi_agent.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.runs import sluice_run

from sluice.metrics import read_jsonl

pytestmark = pytest.mark.slow

STEPS = 8
SMALL = (f"learner.total_steps={STEPS}", "learner.audit_consumed=true", "rollout.prompts_per_batch=4")


def trained_ids(run_dir: Path, suffix: str) -> list[str]:
    return [i for r in read_jsonl(run_dir / "metrics" / f"consumed{suffix}.jsonl") for i in r["trained"]]


def check_learner(run_dir: Path, suffix: str) -> list[dict]:
    steps = read_jsonl(run_dir / "metrics" / f"learner{suffix}.jsonl")
    assert [s["version"] for s in steps] == list(range(1, STEPS + 1))
    assert max(s["staleness_max"] for s in steps) <= 1 and steps[-1]["total_violations"] == 0
    return steps


def test_propose_solve_trains_each_agent_on_its_own_policy_exactly_once(tmp_path):
    run_dir = tmp_path / "run"
    proc = sluice_run(run_dir, *SMALL, config="multi_agent/propose_solve.yaml")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ids = {}
    for policy, suffix in (("proposer", ""), ("solver", "-solver")):
        steps = check_learner(run_dir, suffix)
        ids[policy] = trained_ids(run_dir, suffix)
        assert len(ids[policy]) == len(set(ids[policy])) == sum(s["samples"] for s in steps)
        assert all(f"/{policy}/" in i for i in ids[policy])  # its own agent's turns only
    assert not set(ids["proposer"]) & set(ids["solver"])
    rollouts = read_jsonl(run_dir / "metrics" / "rollout-0.jsonl")
    assert all(r["reward/proposer"] == r["mean/proposer/team"] for r in rollouts)  # the team reward
    assert {"version/proposer", "version/solver"} <= set(rollouts[-1])
    for ckpt in ("checkpoints", "checkpoints-solver"):
        assert (run_dir / ckpt / "latest").exists()


@pytest.mark.parametrize("source", ["received", "checkpoints"])
def test_duel_self_play_trains_one_seat_against_past_versions(tmp_path, source):
    run_dir = tmp_path / "run"
    pool = f"task.agents.second.opponent_pool={{every: 3, size: 2, latest: 0.0, source: {source}}}"
    ckpt = ("learner.checkpoint_every=3", "learner.keep_checkpoints=3")
    proc = sluice_run(run_dir, *SMALL, pool, *ckpt, config="multi_agent/duel.yaml")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    steps = check_learner(run_dir, "")
    ids = trained_ids(run_dir, "")
    assert len(ids) == len(set(ids)) == sum(s["samples"] for s in steps)
    assert all("/first/" in i for i in ids)  # the pool's seat is never trained
    rollouts = read_jsonl(run_dir / "metrics" / "rollout-0.jsonl")
    opponents = {r["opponent_version/second"] for r in rollouts}
    assert 0 in opponents and opponents <= {0, 3, 6}
    assert all(r["reward/first"] + r["reward/second"] == pytest.approx(1.0) for r in rollouts)
