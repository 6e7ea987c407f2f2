"""Smoke tests of benchmarks/weight_sync.py --quick and benchmarks/wire_checksum.py on CPU:
they run end to end (receiver processes, raw ceiling, phases) and write whole JSON."""

from __future__ import annotations

import json

from helpers.bench_scripts import run_script as run


def test_weight_sync_benchmark_quick(tmp_path):
    out = tmp_path / "ws.json"
    run(
        ["benchmarks/weight_sync.py", "--quick", "--receivers", "1", "2", "--repeats", "1", "--out", str(out)]
    )
    data = json.loads(out.read_text())
    assert data["backend"] == "gloo" and data["piece_mb"] == 16.0
    assert [c["receivers"] for c in data["cases"]] == [1, 2]
    for case in data["cases"]:
        assert case["ratio"] > 0 and case["raw_gbps"] > 0
        # the phases cover the publish: sending then waiting for every verified report
        (send,), (confirm,), (publish,) = case["send_s"], case["confirm_s"], case["publish_s"]
        assert 0 < send and 0 < confirm and send + confirm <= publish
    assert len(data["cases"][0]["pull_s"]) == 1  # the late joiner's ZeroMQ pull


def test_wire_checksum_benchmark_on_cpu(tmp_path):
    out = tmp_path / "wc.json"
    proc = run(
        ["benchmarks/wire_checksum.py", "--mb", "4", "--repeats", "1", "--no-compile", "--out", str(out)]
    )
    data = json.loads(out.read_text())
    assert data["wsum32_device_equals_cpu"] is True
    assert set(data["gbps"]) == {"device copy (yardstick)", "xxh3", "wsum32"}
    assert all(v > 0 for v in data["gbps"].values())
    assert "wsum32" in proc.stdout
