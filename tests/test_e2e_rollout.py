"""End to end with the rollout features on: `sluice run` with a multi-turn task and partial
rollouts, and with the vllm engine."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from helpers.runs import ROOT, sluice_run

from sluice.metrics import read_jsonl

pytestmark = pytest.mark.slow


def test_multi_turn_task_with_partial_rollouts_trains(tmp_path):
    run_dir = tmp_path / "run"
    proc = sluice_run(
        run_dir,
        "task.name=calculator",
        "task.params={operands: 2, max_turns: 3}",
        "model.init.vocab=arith",
        "rollout.on_new_weights=continue",
        "rollout.max_new_tokens=4",
        "rollout.group_size=8",
        "learner.batch_size=32",
        "learner.total_steps=8",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = read_jsonl(run_dir / "metrics" / "learner.jsonl")
    assert [s["version"] for s in steps] == list(range(1, 9))
    assert all(np.isfinite(s["loss"]) for s in steps)
    assert steps[-1]["total_violations"] == 0
    batches = read_jsonl(run_dir / "metrics" / "rollout-0.jsonl") + read_jsonl(
        run_dir / "metrics" / "rollout-1.jsonl"
    )
    assert batches and all(b["tokens"] > 0 for b in batches)


@pytest.mark.vllm
def test_quickstart_with_the_vllm_engine(tmp_path):
    pytest.importorskip("vllm")
    run_dir = tmp_path / "run"
    proc = sluice_run(
        run_dir, "rollout.engine=vllm", "rollout.services=1", "learner.total_steps=10", timeout=400
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = read_jsonl(run_dir / "metrics" / "learner.jsonl")
    assert len(steps) == 10
    assert all(s["staleness_max"] <= 2 for s in steps) and steps[-1]["total_violations"] == 0
    # behaviour log-probs from vLLM agree with the learner: importance ratios stay near 1
    # for the freshest samples (log_ratio_abs_mean covers stale ones too, so it is loose)
    assert steps[0]["log_ratio_abs_mean"] < 1e-3, steps[0]


def test_rollout_benchmark_smoke(tmp_path):
    """The sim part of benchmarks/rollout_throughput.py runs end to end and writes its JSON."""
    import json

    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/rollout_throughput.py", "--part", "sim", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["sim"]["rows"]
    assert [r["services"] for r in rows] == [1, 2]
    assert all(r["samples_per_s"] > 0 for r in rows)
