"""End to end with real processes: CartPole through the actor-learner path, two policies in
one run, and a DeepSpeed ZeRO-2 learner group of 2 ranks training the quickstart task."""

from __future__ import annotations

import pytest
from helpers.runs import sluice_run

from sluice.metrics import read_jsonl

pytestmark = pytest.mark.slow


def test_cartpole_reaches_475_through_the_actor_learner_path(tmp_path):
    run_dir = tmp_path / "run"
    proc = sluice_run(run_dir, "run.seed=0", "learner.total_steps=600", config="cartpole.yaml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = read_jsonl(run_dir / "metrics" / "learner.jsonl")
    last = steps[-1]
    assert last["episode_return_mean"] >= 475, last["episode_return_mean"]
    assert last["version"] < 600  # it stopped because the target was reached
    assert all(s["staleness_max"] <= 2 for s in steps) and last["total_violations"] == 0
    rollouts = read_jsonl(run_dir / "metrics" / "rollout-0.jsonl")
    assert rollouts and rollouts[-1]["version"] > 0  # the actors acted with published weights


def test_two_policies_train_in_one_run_on_their_own_streams(tmp_path):
    run_dir = tmp_path / "run"
    proc = sluice_run(
        run_dir,
        "learner.policies=[left, right]",
        "learner.total_steps=8",
        "learner.target_return=null",
        "learner.audit_consumed=true",
        "env.num_envs=4",
        "learner.batch_size=8",
        config="cartpole.yaml",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # group ids start with the service incarnation that made them: rollout-<i>.<hex>/<unroll>
    for suffix, service in (("", "rollout-0."), ("-right", "rollout-1.")):
        steps = read_jsonl(run_dir / "metrics" / f"learner{suffix}.jsonl")
        assert [s["version"] for s in steps] == list(range(1, 9))  # its own version counter
        trained = [
            i for r in read_jsonl(run_dir / "metrics" / f"consumed{suffix}.jsonl") for i in r["trained"]
        ]
        assert len(trained) == 8 * 8 and all(i.startswith(service) for i in trained)  # its own stream
        assert (run_dir / f"checkpoints{suffix}" / "step_000008").is_dir()
    assert {"learner", "learner-right"} <= {p.stem for p in (run_dir / "endpoints").glob("*.json")}


def test_deepspeed_zero2_two_ranks_run_the_quickstart_task(tmp_path):
    """The actor-learner path with a DeepSpeed group of 2 ranks: batches split over the ranks,
    weights published from the partitioned optimizer, a DeepSpeed checkpoint. That its update
    equals one process's is test_learner_group.py's (ZeRO-2 and -3); that the quickstart learns,
    test_e2e_local.py's."""
    run_dir = tmp_path / "run"
    proc = sluice_run(
        run_dir,
        "learner.total_steps=12",
        "learner.ranks=2",
        "learner.backend=deepspeed",
        "learner.zero_stage=2",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = read_jsonl(run_dir / "metrics" / "learner.jsonl")
    assert [s["version"] for s in steps] == list(range(1, 13))
    assert all(s["grad_norm"] > 0 and s["samples"] == 128 for s in steps)
    assert all(s["staleness_max"] <= 2 for s in steps) and steps[-1]["total_violations"] == 0
    ckpt = run_dir / "checkpoints" / "step_000012"
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "deepspeed").is_dir()
    assert {"learner", "learner-r1"} <= {p.stem for p in (run_dir / "endpoints").glob("*.json")}
