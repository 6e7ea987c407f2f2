"""Sharded learners (FSDP2, DeepSpeed ZeRO-3; 2 ranks on gloo) publish bucket by bucket: the
receiver gets the full weights bit-identical, and no gather materializes more than a bucket."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.procs import start
from helpers.weight_sync_env import ROOT, ProbeProcess

from sluice.config.weight_sync import WeightSyncConfig
from sluice.net import free_port

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode", ["fsdp", "zero3"])
def test_sharded_source_publishes_bucket_by_bucket(mode, tmp_path, process_reaper):
    if mode == "zero3":
        pytest.importorskip("deepspeed")
    dist_port, ws_port, control_port = free_port(), free_port(), free_port()
    ranks = []
    for rank in (0, 1):
        args = [
            str(ROOT / "tests" / "helpers" / "sharded_publisher.py"),
            f"--rank={rank}",
            f"--mode={mode}",
            f"--dist-port={dist_port}",
            f"--ws-port={ws_port}",
            f"--control-port={control_port}",
            f"--out={tmp_path}",
        ]
        with (tmp_path / f"rank{rank}.log").open("wb") as log:
            ranks.append(start(args, process_reaper, stdout=log, OMP_NUM_THREADS="1"))

    cfg = WeightSyncConfig(master_port=ws_port)
    probe = ProbeProcess(cfg, f"tcp://127.0.0.1:{control_port}", "rollout-0", tmp_path)
    try:
        for proc in ranks:
            proc.wait(timeout=240)
        logs = "\n".join(Path(tmp_path / f"rank{r}.log").read_text()[-2000:] for r in (0, 1))
        assert [p.returncode for p in ranks] == [0, 0], logs
        result = json.loads((tmp_path / "result.json").read_text())
        for version, want in result["digests"].items():
            got = probe.wait_version(int(version))
            assert got["version"] == int(version) and got["digest"] == want, (version, probe.log_tail())
        # bucket by bucket: never the whole model at once
        assert result["buckets"] >= 2 and result["gathers"] == 2 * result["buckets"]  # 2 versions
        assert result["max_gather_numel"] <= result["bucket_numel"] < result["model_numel"]
    finally:
        probe.close()
