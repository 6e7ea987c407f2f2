"""The experience archive: with buffer.archive the log keeps every segment compaction retires,
and `sluice experience` reads every trajectory a shard stored with its fate, once each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import yaml
from helpers.groups import make_group
from helpers.wait import wait_until

from sluice.buffer.client import BufferClient
from sluice.buffer.history import Fate, fates, shard_segments, trajectories
from sluice.experience import export_experience

ROOT = Path(__file__).resolve().parents[1]


def fill(shard_factory, log: Path) -> dict[str, str]:
    """A shard with an archive and tiny segments: groups acked, dropped as stale, left held
    and leased, across several compactions. Returns traj_id -> the fate it must have."""
    shard = shard_factory(
        log_dir=log, archive=True, fsync="none", segment_bytes=1 << 16, compact_min_bytes=1 << 16
    )
    expected: dict[str, str] = {}
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        for i in range(60):
            trajs = make_group(f"g{i}", 2, version=i // 20, nbytes=4096)
            client.put(trajs)
        for _ in range(10):  # 20 groups of version 0 acked
            batch = client.get(4)
            client.ack(batch)
            expected.update(dict.fromkeys((t.traj_id for t in batch.trajs), "acked"))
        stale = client.get(4, min_version=2)  # version 1 dropped, two groups of version 2 leased
        expected.update({t.traj_id: "held" for t in stale.trajs})
        for i in range(20, 40):
            expected.update(dict.fromkeys((f"g{i}/0", f"g{i}/1"), "dropped"))
        for i in range(42, 60):
            expected.update(dict.fromkeys((f"g{i}/0", f"g{i}/1"), "held"))
        wait_until(lambda: client.stats()[0].stats["compactions"] >= 1, 10, "a compaction")
        wait_until(shard.server.log.compaction_done, 30, "the shard finished its compaction")
    return expected


def test_every_trajectory_and_its_fate_once_across_compactions(shard_factory, tmp_path):
    log = tmp_path / "logs" / "shard-0"
    expected = fill(shard_factory, log)
    assert any(p.parent.name == "archive" for _, p in shard_segments(log))
    fate, dtypes = fates(log)
    assert dtypes == {"x": "int32"}
    got = {t.traj_id: f for _, t, f in trajectories(log, fate)}
    assert {i: f.status for i, f in got.items()} == expected  # each once, the right fate
    assert all(f.lease_id for f in got.values() if f.status == "acked")
    assert Fate().status == "held"


def test_export_writes_parquet_and_a_dataset_directory(shard_factory, tmp_path):
    log = tmp_path / "logs" / "shard-0"
    expected = fill(shard_factory, log)
    run = tmp_path / "run"
    run.mkdir()
    cfg = {"run": {"dir": str(run)}, "buffer": {"log_dir": str(tmp_path / "logs"), "archive": True}}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    summary = export_experience(run, tmp_path / "x.parquet", "parquet")
    assert summary.rows == len(expected) == 120 and summary.fates["acked"] == 40
    table = pq.read_table(tmp_path / "x.parquet").to_pylist()
    assert {r["traj_id"]: r["fate"] for r in table} == expected
    g0 = next(r for r in table if r["traj_id"] == "g0/0")
    assert g0["array_x"] == [0] * 1024 and g0["version"] == 0 and g0["policy_id"] == "default"
    proc = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "experience", str(run), str(tmp_path / "ds"), "--format", "hf"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "120 trajectories from 1 shards (acked 40, dropped 40, held 40)" in proc.stdout
    import datasets

    ds = datasets.load_from_disk(str(tmp_path / "ds"))
    assert len(ds) == 120 and set(ds.column_names) >= {"traj_id", "fate", "array_x"}  # type: ignore[arg-type]
    bad = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "experience", str(tmp_path), str(tmp_path / "y")],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "not a run directory" in bad.stderr
