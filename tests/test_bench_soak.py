"""benchmarks/soak.py: the flatness rule against hand-made samples, and a smoke run of --quick
(every role sampled, the run stopped as by Ctrl-C, the JSON whole)."""

from __future__ import annotations

import json

import pytest
from helpers.bench_scripts import ROOT, run_script


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import soak

    return soak


def test_a_role_is_flat_within_ten_percent_and_five_descriptors(bench):
    def at(t, anon, fds, segs=0, file_mb=0):
        roles = {"learner": {"rss_mb": anon + file_mb, "anon_mb": anon, "fds": fds, "seg_fds": segs}}
        return {"t": t, "roles": roles}

    samples = [at(0, 50, 10), at(60, 100, 20), at(120, 109, 25), at(180, 109.5, 25)]
    (row,) = bench.summarise(samples, warmup=60)
    assert row["t0"] == 60 and row["anon_growth"] == pytest.approx(0.095) and row["flat"]  # (warm-up ignored)
    (grew,) = bench.summarise([at(60, 100, 20), at(120, 111, 20)], warmup=60)
    assert not grew["flat"]
    (opened,) = bench.summarise([at(60, 100, 20), at(120, 100, 26)], warmup=60)
    assert not opened["flat"]
    # mapped segments: file pages and descriptors a reader keeps (bounded), not a leak
    (mapped,) = bench.summarise([at(60, 100, 20, 1, 64), at(120, 100, 27, 8, 512)], warmup=60)
    assert mapped["flat"] and mapped["rss_end_mb"] == 612


@pytest.mark.slow
def test_soak_quick(tmp_path):
    run_script(["benchmarks/soak.py", "--quick", "--out", str(tmp_path)], timeout_s=240)
    data = json.loads((tmp_path / "soak.json").read_text())
    assert data["exit_code"] == 130 and data["steps"] > 0
    assert {r["role"] for r in data["roles"]} == {"buffer-0", "learner", "rollout-0", "rollout-1"}
    assert (tmp_path / "soak.png").stat().st_size > 0
