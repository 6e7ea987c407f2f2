"""Smoke tests of benchmarks/buffer_throughput.py --quick (and --netns): every system runs, the
JSON is whole."""

from __future__ import annotations

import json
import subprocess

import pytest
from helpers.bench_scripts import run_script

from sluice.testing.netns import unavailable


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


@pytest.mark.slow
def test_buffer_benchmark_between_two_namespaces(tmp_path):
    """--netns: raw ZeroMQ, the relay and Sluice between two network namespaces, in the same
    table and JSON as the loopback cases, Sluice with every byte in ZeroMQ frames."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    out = tmp_path / "bench.json"
    args = ["--quick", "--netns", "--no-ray", "--sizes", "256KB", "--shards", "1", "--transports", "zmq"]
    proc = run_script(["benchmarks/buffer_throughput.py", *args, "--out", str(out)], timeout_s=600)
    assert "over veth" in proc.stdout
    data = json.loads(out.read_text())
    cases = {(c["system"], c["link"]): c for c in data["cases"]}
    for system in ("raw_zmq", "raw_zmq_relay", "sluice"):
        assert {(system, ""), (system, "veth")} <= set(cases)
        assert cases[(system, "veth")]["mb_per_s"] > 0
    assert cases[("sluice", "veth")]["shared_fraction"] == 0.0
    assert cases[("sluice", "veth")]["name"] == "sluice zmq (log, fsync=none) over veth"
    assert set(data["machine"]["netns"]) == {"client", "shards"}
    assert not any(name.startswith(data["machine"]["netns_tag"]) for name in netns_names())


def netns_names() -> list[str]:
    """The network namespaces `ip netns` lists (the benchmark must leave none of its own)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listing.splitlines() if line.strip()]
