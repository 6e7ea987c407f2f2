"""scripts/gpu_check.sh --dry-run: the GPU check's steps on CPU with tiny sizes (quickstart for a
few steps, weight_sync --quick, rollout_throughput --quick) write the same layout as on a GPU."""

from __future__ import annotations

import getpass
import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def inductor_cache() -> dict[str, str]:
    """TORCHINDUCTOR_CACHE_DIR as set, or torch's default for this user and temp dir."""
    where = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return {
        "TORCHINDUCTOR_CACHE_DIR": where
        or str(Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")
    }


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path, process_reaper):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        ["bash", "scripts/gpu_check.sh", "--dry-run"],
        cwd=ROOT,
        # TMPDIR: the script's work folder lands in tmp_path even if it is killed. Torch's compile
        # cache stays where it is (under the machine's temp dir): in a fresh one, the compile of
        # vLLM's log-prob rank kernel cost the engines step ~30 s on every run of this test.
        env={**os.environ, "OUT": str(out), "TMPDIR": str(tmp_path), "COLUMNS": "160", **inductor_cache()},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the reaper kills its process group
    )
    process_reaper.append(proc)
    log, _ = proc.communicate(timeout=900)
    summary = json.loads((out / "summary.json").read_text())
    assert proc.returncode == 0 and summary["ok"] is True, log[-4000:]
    assert summary["mode"] == "dry"
    steps = {s["name"]: s for s in summary["steps"]}
    assert list(steps) == ["env", "quickstart", "weight_sync", "rollout_throughput"]
    assert steps["env"]["status"] == "ok" and steps["quickstart"]["status"] == "ok"
    assert summary["machine"]["torch"] and summary["machine"]["cuda_available"] in (True, False)
    qs = summary["quickstart"]
    assert qs["versions"] == 6 and qs["learner_device"] == "cpu" and qs["engine"] == "hf"
    assert 0 <= qs["start_reward"] <= 1 and 0 <= qs["end_reward"] <= 1
    assert qs["staleness_max"] <= 2 and qs["staleness_violations"] == 0 and qs["wall_s"] > 0
    assert qs["weight_sync_backend"] == "gloo"
    assert json.loads((out / "quickstart.json").read_text()) == qs
    ws = json.loads((out / steps["weight_sync"]["json"]).read_text())
    assert ws["device"] == "cpu" and [c["receivers"] for c in ws["cases"]] == [1]
    rt = steps["rollout_throughput"]
    if summary["machine"]["vllm"]:  # the engines part runs only where vllm imports
        assert rt["status"] == "ok"
        assert json.loads((out / rt["json"]).read_text())["engines"]["rows"]
    else:
        assert rt["status"] == "skipped" and "vllm" in rt["reason"]
    assert (out / "gpu_check.log").stat().st_size > 0
    assert not list(tmp_path.glob("sluice-gpu-check-*")), "the work folder is removed at exit"
