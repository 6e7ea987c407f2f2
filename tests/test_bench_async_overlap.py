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
    assert row["speedup"] == pytest.approx(data["sync_s_per_step"] / row["s_per_step"])
    assert row["fraction_of_ideal"] == pytest.approx(row["speedup"] / data["ideal_speedup"])
    assert data["target"]["max_staleness"] == 2 and isinstance(data["target"]["met"], bool)
    assert (tmp_path / "sim.png").stat().st_size > 0
    assert "async overlap, workload sim" in out
