"""A run's experience, as its shards' logs recorded it: every trajectory stored, and its fate.

A durable shard logs each PUT (the trajectories), ACK (consumed by a learner), DROP (too stale)
and, in replay mode, the groups a PUT evicted. With `buffer.archive` no segment is ever
deleted, so reading every segment in order (archived ones first) tells each trajectory's whole
story: `acked` (with the lease that consumed it), `dropped`, `evicted`, or `held` (still in
the shard). Without it, compaction deletes what was consumed, and only what is still held or
has not yet been compacted away can be read. `sluice export` writes it as Parquet or a Hugging
Face dataset directory (docs/architecture.md, Buffer: the experience archive).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sluice.buffer.log_reader import put_groups, segment_records
from sluice.buffer.log_records import AckRecord, CorruptRecord, DropRecord, PutRecord
from sluice.buffer.segment_log import ARCHIVE_DIR
from sluice.trajectory import Trajectory

log = logging.getLogger(__name__)

Status = Literal["acked", "dropped", "evicted", "held"]


@dataclass(frozen=True)
class Fate:
    status: Status = "held"
    lease_id: str = ""  # acked: the lease that consumed it


def shard_segments(directory: Path) -> list[tuple[int, Path]]:
    """(number, path) of every segment of a shard's log, archived and live, oldest first."""
    paths = [*(directory / ARCHIVE_DIR).glob("*.seg"), *directory.glob("*.seg")]
    return sorted((int(p.stem), p) for p in paths)


def _records(directory: Path) -> Iterator[tuple[object, object, object]]:
    """Every record of the shard's log, in order; a torn tail of the newest segment ends it
    (as recovery ends it), damage anywhere else raises."""
    segments = shard_segments(directory)
    for i, (n, path) in enumerate(segments):
        try:
            for item, where in segment_records(path, n):
                yield item.record, item.payload, where
        except CorruptRecord as e:
            if i != len(segments) - 1:
                raise CorruptRecord(f"{path}: {e}") from None
            log.warning("%s: the log ends at a damaged record (%s)", path, e)


def fates(directory: Path) -> tuple[dict[int, Fate], dict[str, str]]:
    """Each group's fate by seq, and the name and dtype of every array any trajectory carries."""
    out: dict[int, Fate] = {}
    names: dict[str, str] = {}
    for record, _, _ in _records(directory):
        if isinstance(record, PutRecord):
            for logged in record.groups:
                out.setdefault(logged.seq, Fate())
                names.update({s.name: s.dtype for m in logged.trajs for s in m.arrays})
            out.update(dict.fromkeys(record.evicted, Fate("evicted")))
        elif isinstance(record, AckRecord):
            out.update(dict.fromkeys(record.seqs, Fate("acked", record.lease_id)))
        elif isinstance(record, DropRecord):
            out.update(dict.fromkeys(record.seqs, Fate("dropped")))
    return out, names


def trajectories(directory: Path, fate: dict[int, Fate]) -> Iterator[tuple[int, Trajectory, Fate]]:
    """(seq, trajectory, fate) of every trajectory the shard stored, once (a compaction's
    snapshot restates live groups: they are not repeated)."""
    seen: set[int] = set()
    for record, payload, where in _records(directory):
        if not isinstance(record, PutRecord):
            continue
        for group in put_groups(record, payload, where):  # type: ignore[arg-type]
            if group.seq in seen:
                continue
            seen.add(group.seq)
            for t in group.trajs:
                yield group.seq, Trajectory.from_wire(t.meta, t.frames), fate.get(group.seq, Fate())


def row(shard: int, seq: int, t: Trajectory, f: Fate, names: Iterable[str]) -> dict:
    """One trajectory as a table row: ids, policy, version, reward, info (JSON), fate, and one
    list column per array name (None where it has no such array)."""
    out = {
        "shard": shard,
        "seq": seq,
        "traj_id": t.traj_id,
        "group_id": t.group_id,
        "group_size": t.group_size,
        "policy_id": t.policy_id,
        "version": t.version,
        "reward": t.reward,
        "info": json.dumps(t.info, sort_keys=True),
        "fate": f.status,
        "lease_id": f.lease_id,
    }
    for name in names:
        a = t.arrays.get(name)
        out[f"array_{name}"] = None if a is None else a.reshape(-1).tolist()
    return out
