"""Smoke test of benchmarks/buffer_throughput.py --quick: every system runs, the JSON is whole."""

from __future__ import annotations

import json

import pytest
from helpers.bench_scripts import run_script


@pytest.mark.slow
def test_buffer_benchmark_quick(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_script(["benchmarks/buffer_throughput.py", "--quick", "--out", str(out)], timeout_s=600)
    assert "Buffer throughput" in proc.stdout and "Shard memory at capacity" in proc.stdout
    data = json.loads(out.read_text())
    cases = {(c["system"], c["transport"], c["shards"], c["size"]) for c in data["cases"]}
    for size in (1024, 256 * 1024):
        assert {("raw_zmq", "", 0, size), ("raw_zmq_relay", "", 0, size), ("ray_queue", "", 0, size)} <= cases
        for transport in ("zmq", "same-host"):
            assert {("sluice", transport, 1, size), ("sluice", transport, 4, size)} <= cases
    for c in data["cases"]:  # each transport carried what it says
        if c["system"] == "sluice" and c["shards"] == 1:
            assert c["shared_fraction"] == (1.0 if c["transport"] == "same-host" else 0.0), c
    assert all(c["mb_per_s"] > 0 and c["trajs_per_s"] > 0 for c in data["cases"])
    # CPU time is counted in 10 ms ticks: a --quick case may take less than one
    sluice_cpu = [c["cpu_s"] for c in data["cases"] if c["system"] == "sluice"]
    assert all(t is not None and t >= 0 for t in sluice_cpu) and sum(sluice_cpu) > 0, sluice_cpu
    for memory in data["memory"]:
        assert memory["held_bytes"] == memory["capacity"] * memory["size"]  # filled to capacity
        assert memory["rss_full"] > memory["rss_empty"]
