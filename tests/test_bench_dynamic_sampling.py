"""benchmarks/dynamic_sampling.py --quick: real processes (a shard, the stand-in learner, two
sim services) under DAPO's filter, with and without oversampling; the report's layout, and the
fewer generate calls that oversampling is for."""

from __future__ import annotations

import json

from helpers.bench_scripts import run_script


def test_dynamic_sampling_benchmark_quick(tmp_path):
    proc = run_script(["benchmarks/dynamic_sampling.py", "--quick", "--out", str(tmp_path)], timeout_s=120)
    report = json.loads((tmp_path / "dynamic_sampling.json").read_text())
    assert (tmp_path / "dynamic_sampling.png").stat().st_size > 0 and "speed-up" in proc.stdout
    plain, over = report["rows"]
    assert (plain["oversample"], over["oversample"]) == (1.0, 2.0) and plain["speedup_vs_baseline"] == 1.0
    assert plain["surplus_per_step"] == 0 and plain["dropped_per_step"] > 0  # the filter dropped groups
    assert over["calls_per_step"] < plain["calls_per_step"]  # a call fills its grant
    assert all(r["s_per_step"] > 0 for r in report["runs"])
