"""`sluice experience RUN_DIR OUT`: a run's experience as Parquet or a Hugging Face dataset.

One row per trajectory any shard of the run stored (`buffer/history.py`): ids, policy,
version, reward, info, its arrays (token ids, behaviour log-probs, ... one list column each)
and its fate, `acked` (consumed, with the lease), `dropped` (too stale), `evicted` (replay) or
`held` (still in the shard). Complete with `buffer.archive: true`; without it, what compaction
deleted is missing. For audits (the chaos tests account for every trajectory by id with it),
debugging and offline RL. Rows are written in batches: memory stays bounded by a batch.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from sluice.config.loader import load_config

BATCH_ROWS = 4096


@dataclass
class ExportSummary:
    path: Path
    rows: int = 0
    fates: Counter = field(default_factory=Counter)  # fate -> trajectories
    shards: int = 0


def _schema(dtypes: dict[str, str]):
    import numpy as np
    import pyarrow as pa

    fields = [
        ("shard", pa.int32()), ("seq", pa.int64()), ("traj_id", pa.string()), ("group_id", pa.string()),
        ("group_size", pa.int32()), ("policy_id", pa.string()), ("version", pa.int64()),
        ("reward", pa.float64()), ("info", pa.string()), ("fate", pa.string()), ("lease_id", pa.string()),
    ]  # fmt: skip
    for name, dtype in dtypes.items():  # bfloat16 arrays come as their raw 16-bit words
        element = pa.from_numpy_dtype(np.dtype("uint16" if dtype == "bfloat16" else dtype))
        fields.append((f"array_{name}", pa.list_(element)))
    return pa.schema(fields)


def write_parquet(run_dir: Path, out: Path) -> ExportSummary:
    """Every shard's history into one Parquet file at `out`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sluice.buffer.history import fates, row, trajectories

    cfg = load_config(run_dir / "config.yaml")
    dirs = [cfg.buffer.shard_log_dir(k, run_dir) for k in range(cfg.buffer.shards)]
    known = [(k, d, *fates(d)) for k, d in enumerate(dirs) if d is not None and d.is_dir()]
    dtypes = {name: t for *_, names in known for name, t in names.items()}
    summary = ExportSummary(out, shards=len(known))
    schema = _schema(dtypes)
    with pq.ParquetWriter(out, schema) as writer:
        rows: list[dict] = []
        for shard, directory, fate, _ in known:
            for seq, t, f in trajectories(directory, fate):
                rows.append(row(shard, seq, t, f, dtypes))
                summary.fates[f.status] += 1
                if len(rows) >= BATCH_ROWS:
                    writer.write_table(pa.Table.from_pylist(rows, schema=schema))
                    summary.rows, rows = summary.rows + len(rows), []
        writer.write_table(pa.Table.from_pylist(rows, schema=schema))
        summary.rows += len(rows)
    return summary


def export_experience(run_dir: str | Path, out: str | Path, fmt: Literal["parquet", "hf"]) -> ExportSummary:
    """Write the run's experience: a Parquet file, or a Hugging Face dataset directory
    (`datasets.load_from_disk`)."""
    run_dir, out = Path(run_dir), Path(out)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir}: no config.yaml (not a run directory)")
    if fmt == "parquet":
        return write_parquet(run_dir, out)
    import datasets

    with tempfile.TemporaryDirectory() as tmp:
        summary = write_parquet(run_dir, Path(tmp) / "experience.parquet")
        ds = datasets.Dataset.from_parquet(str(Path(tmp) / "experience.parquet"))
        if out.exists():
            shutil.rmtree(out)
        ds.save_to_disk(str(out))  # type: ignore[union-attr]
    summary.path = out
    return summary
