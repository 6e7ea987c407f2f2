"""Every shipped workflow runs end to end under `sluice run` (real processes, real ZeroMQ): the
quickstart with its `workflow:` switched, and CartPole with its loss keys replaced by a
workflow. Changing the algorithm of a run is one key (docs/workflows.md)."""

from __future__ import annotations

import math

import pytest
from helpers.runs import sluice_run
from helpers.workflows import ENV_WORKFLOWS, LLM_WORKFLOWS, cartpole_with

from sluice.metrics import read_jsonl

pytestmark = pytest.mark.slow

STEPS = 3


@pytest.mark.parametrize("name", [w for w in LLM_WORKFLOWS if w != "grpo"])  # grpo: the quickstart tests
def test_an_llm_workflow_runs_end_to_end(tmp_path, name):
    run_dir = tmp_path / "run"
    small = ("learner.batch_size=32", "rollout.prompts_per_batch=2", "buffer.capacity=256")
    small += ("rollout.services=1",)  # a process less to start: this checks the workflow, not scaling
    proc = sluice_run(run_dir, f"workflow={name}", f"learner.total_steps={STEPS}", *small)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    steps = read_jsonl(run_dir / "metrics" / "learner.jsonl")
    assert [s["version"] for s in steps] == list(range(1, STEPS + 1))
    assert all(math.isfinite(s["loss"]) and s["grad_norm"] > 0 for s in steps), steps
    if name == "reinforce_pp":
        assert all("kl_ref" in s for s in steps)
    if name == "ppo_critic":
        assert all(s["value_loss"] > 0 and s["critic_grad_norm"] > 0 for s in steps)
        assert (run_dir / "checkpoints" / "latest" / "critic.pt").is_file()
    if name == "dapo":
        rollouts = [r for f in (run_dir / "metrics").glob("rollout-*.jsonl") for r in read_jsonl(f)]
        assert rollouts and all("dropped_groups" in r and "uniform_kept" in r for r in rollouts)


@pytest.mark.parametrize("name", ENV_WORKFLOWS)
def test_a_classic_workflow_runs_end_to_end(tmp_path, name):
    run_dir = tmp_path / "run"
    config = str(cartpole_with(name, tmp_path))
    proc = sluice_run(run_dir, f"learner.total_steps={STEPS}", config=config)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    steps = read_jsonl(run_dir / "metrics" / "learner.jsonl")
    assert [s["version"] for s in steps] == list(range(1, STEPS + 1))
    assert all(math.isfinite(s["loss"]) and "value_loss" in s for s in steps), steps
