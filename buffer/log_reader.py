"""Reading a shard's segment files: their records in order, and the groups a PUT record holds.

Recovery (`segment_log.py`) folds these into the state a restarted shard serves; the archive
export (`buffer/history.py`) reads every segment a shard ever wrote. On-disk framing:
`log_records.py`; the log's story: docs/architecture.md (Buffer: durability).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

from sluice.buffer.groups import Group, Loc, StoredTrajectory
from sluice.buffer.log_records import (
    CorruptRecord,
    PutRecord,
    ReadRecord,
    RegionRecord,
    SealRecord,
    array_sizes,
    read_record,
    split_group_frames,
)


@dataclass
class Where:
    """Where a record being read lies."""

    segment: int
    payload_at: int  # file offset of its payload
    fd: int  # the segment file, open for reading
    record_at: int  # file offset of the record


def region_payload(record: PutRecord, where: Where) -> tuple[memoryview, list[Loc]]:
    """A PUT record's payload read from its region, checked, as one buffer with the
    trajectories back to back (as an inline payload is), and their places in the file."""
    if len(record.region) != 3:
        raise CorruptRecord(f"PUT record region {record.region} is not [offset, nbytes, checksum]")
    offset, nbytes, checksum = record.region
    if offset < 0 or nbytes < 0 or offset + nbytes > where.record_at:
        raise CorruptRecord(f"PUT record region [{offset}, {offset + nbytes}) is not before the record")
    region = os.pread(where.fd, nbytes, offset)
    if len(region) != nbytes or xxhash.xxh3_64_intdigest(region) != checksum:
        raise CorruptRecord(
            f"the region [{offset}, {offset + nbytes}) of a PUT record does not match its checksum"
        )
    metas = [m for g in record.groups for m in g.trajs]
    if len(record.traj_at) != len(metas):
        raise CorruptRecord(f"PUT record has {len(metas)} trajectories and {len(record.traj_at)} places")
    parts, locs = [], []
    for meta, at in zip(metas, record.traj_at):
        size = sum(array_sizes(meta))
        if not offset <= at <= offset + nbytes - size:
            raise CorruptRecord(f"trajectory at byte {at} is outside its region")
        parts.append(region[at - offset : at - offset + size])
        locs.append((where.segment, at))
    return memoryview(b"".join(parts)), locs


def put_groups(record: PutRecord, payload: memoryview, where: Where) -> list[Group]:
    """The groups a PUT record stored, their trajectories' frames views of `payload` (or of
    the region it names), each with its place in the segment."""
    if record.region:
        payload, locs = region_payload(record, where)
    else:
        locs = []
        at = where.payload_at
        for g in record.groups:
            for m in g.trajs:
                locs.append((where.segment, at))
                at += sum(array_sizes(m))
    groups, k = [], 0
    for logged, frames in zip(record.groups, split_group_frames(record.groups, payload)):
        trajs = []
        for m, f in zip(logged.trajs, frames):
            trajs.append(StoredTrajectory(meta=m, frames=f, nbytes=sum(v.nbytes for v in f), loc=locs[k]))
            k += 1
        if not trajs:
            raise CorruptRecord(f"PUT record group seq {logged.seq} has no trajectories")
        first = logged.trajs[0]
        version = min(m.version for m in logged.trajs)
        groups.append(Group(logged.seq, first.group_id, first.policy_id, version, trajs))
    return groups


def segment_records(path: Path, n: int) -> Iterator[tuple[ReadRecord, Where]]:
    """The records of segment `n` (file `path`) up to its SEAL, a clean end, or the first
    damaged record (raised as CorruptRecord, after the good ones before it), REGION records
    skipped. For readers that only read (the export): recovery reads with its own rules."""
    size = path.stat().st_size
    offset = 0
    with path.open("rb") as fh:
        while True:
            item = read_record(fh, size - offset, seed=n)
            if item is None or isinstance(item.record, SealRecord):
                return
            if not isinstance(item.record, RegionRecord):
                yield item, Where(n, offset + item.payload_at, fh.fileno(), offset)
            offset += item.size
