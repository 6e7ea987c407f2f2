"""Smoke tests of benchmarks/weight_sync.py --quick and benchmarks/wire_checksum.py on CPU:
they run end to end (receiver processes, raw ceiling, phases) and write whole JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(args: list[str], timeout_s: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "160"},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


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
