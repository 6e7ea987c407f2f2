"""benchmarks/async_overlap.py: the overlap arithmetic against hand-computed numbers, and a smoke
run of --quick (generation-only, training-only and one async run; the JSON is whole)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # it imports learner_step beside it
    import async_overlap

    return async_overlap


def test_overlap_against_hand_computed(bench):
    # gen 1.0 s + train 0.5 s: synchronous 1.5 s, ideal 1.0 s (1.5x); 1.25 s/step is 1.2x = 80%
    r = bench.overlap(s_per_step=1.25, gen_s=1.0, train_s=0.5)
    assert r["ideal_speedup"] == pytest.approx(1.5)
    assert r["speedup"] == pytest.approx(1.2)
    assert r["fraction_of_ideal"] == pytest.approx(0.8)


def test_a_run_is_set_against_the_measurements_around_it(bench):
    # train 0.4 s before the repeat and 0.6 s after: 0.5; gen 0.5 and 0.7: 0.6. The run took
    # 0.66 s a step: synchronous 1.1 s, 1.667x, ideal 1.1 / 0.6 = 1.833x: 90.9%
    run = {"s_per_step": 0.66, "busy_s_mean": 0.55}
    bench.bracket(
        run, [{"busy_s_mean": 0.4}, {"busy_s_mean": 0.6}], [{"s_per_step": 0.5}, {"s_per_step": 0.7}]
    )
    assert (run["train_s"], run["gen_s"]) == (pytest.approx(0.5), pytest.approx(0.6))
    assert run["fraction_of_ideal"] == pytest.approx((1.1 / 0.66) / (1.1 / 0.6))
    assert run["fraction_of_ideal_in_run"] == pytest.approx((1.15 / 0.66) / (1.15 / 0.6))
    assert bench.medians([{"a": 1, "b": "x"}, {"a": 3, "b": "y"}, {"a": 2}]) == {"a": 2}


def test_sim_decode_step_for_the_quickstart_shape(bench):
    # batch 128 from 2 services of 4 prompts x 16: one call each per batch, 6 decode rounds a call
    cfg = bench.WORKLOADS["sim"].load()
    assert bench.decode_step_per_gen_s(cfg) == pytest.approx(1 / 6)
    assert "rollout.sim.decode_step_s=0.03" in bench.sim_overrides(decode_step_s=0.03)
    assert "rollout.sim.call_s=0.0" in bench.sim_overrides(decode_step_s=0.03)


@pytest.mark.slow
def test_async_overlap_quick(tmp_path, process_reaper):
    proc = subprocess.Popen(
        [sys.executable, "benchmarks/async_overlap.py", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "170"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the reaper kills its process group (and the runs it started)
    )
    process_reaper.append(proc)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    data = json.loads((tmp_path / "sim.json").read_text())
    assert data["workload"] == "sim" and data["quick"] is True
    assert data["gen_s"] > 0 and data["train_s"] > 0
    assert data["generation"]["decode_step_s"] > 0  # tuned from the training step
    assert data["sync_s_per_step"] == pytest.approx(data["gen_s"] + data["train_s"])
    assert data["ideal_speedup"] == pytest.approx(
        data["sync_s_per_step"] / max(data["gen_s"], data["train_s"])
    )
    (row,) = data["rows"]
    assert row["max_staleness"] == 2 and row["s_per_step"] > 0 and row["staleness_max"] <= 2
    # one repeat: training and generation measured before and after it, the run set against their means
    (run,) = data["runs_raw"]
    trains, gens = data["training_raw"], data["generation_raw"]
    assert len(trains) == 2 and len(gens) == 2
    assert run["train_s"] == pytest.approx(sum(t["busy_s_mean"] for t in trains) / 2)
    assert run["gen_s"] == pytest.approx(sum(g["s_per_step"] for g in gens) / 2)
    sync = run["gen_s"] + run["train_s"]
    assert run["speedup"] == pytest.approx(sync / run["s_per_step"])
    assert run["fraction_of_ideal"] == pytest.approx(
        run["speedup"] * max(run["gen_s"], run["train_s"]) / sync
    )
    assert row["fraction_of_ideal"] == pytest.approx(run["fraction_of_ideal"])
    assert data["target"]["max_staleness"] == 2 and isinstance(data["target"]["met"], bool)
    assert (tmp_path / "sim.png").stat().st_size > 0
    assert "async overlap, workload sim" in out
