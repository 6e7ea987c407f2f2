"""Records of a shard's log and their framing on disk.

A record on disk is
    prefix  24 bytes: magic b"SLG1", header length (u32), payload length (u64), checksum (u64)
    header  msgpack map, one of the `*Record` structs below (tagged by "kind")
    payload raw bytes (PUT: the trajectories' array frames in header order; SNAPSHOT: uint64
            dedupe hashes)
all little-endian. The checksum is xxh3-64, seeded with the segment's number, over the two
lengths, the header and the payload: a torn write (power loss mid-record) or a flipped bit is
detected, never loaded, and so is a record left over from a recycled file's previous life
(another segment number, another seed). A closed segment ends with a SEAL record.
Payload frames are written straight from the received ZeroMQ frames with `os.writev`: the
log path copies no array bytes in user space.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Sequence

import msgspec
import xxhash

from sluice.wire.codec import DTYPES, Frame, frame_bytes
from sluice.wire.messages import TrajectoryMeta

MAGIC = b"SLG1"
PREFIX = struct.Struct("<4sIQQ")
LENGTHS = struct.Struct("<IQ")
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


class LoggedGroup(msgspec.Struct, forbid_unknown_fields=True):
    seq: int
    trajs: list[TrajectoryMeta]


class PutRecord(msgspec.Struct, tag_field="kind", tag="put", forbid_unknown_fields=True):
    """Groups stored by a PUT (their frames are the payload) and the groups it evicted (replay)."""

    groups: list[LoggedGroup]
    evicted: list[int] = []


class AckRecord(msgspec.Struct, tag_field="kind", tag="ack", forbid_unknown_fields=True):
    """A lease was ACKed: its groups are gone for good."""

    lease_id: str
    seqs: list[int]


class DropRecord(msgspec.Struct, tag_field="kind", tag="drop", forbid_unknown_fields=True):
    """Groups dropped for staleness."""

    seqs: list[int]


class PriorityRecord(msgspec.Struct, tag_field="kind", tag="priority", forbid_unknown_fields=True):
    """New raw priorities of replay groups."""

    seqs: list[int]
    priorities: list[float]


class SnapshotRecord(msgspec.Struct, tag_field="kind", tag="snapshot", forbid_unknown_fields=True):
    """First record of a compacted segment: forget everything before it. The live groups follow
    as PUT (and PRIORITY) records; the payload holds the dedupe window's hashes (uint64)."""

    next_seq: int
    settled: dict[str, int] = {}  # recently ACKed lease ids -> trajectories


class SealRecord(msgspec.Struct, tag_field="kind", tag="seal", forbid_unknown_fields=True):
    """The segment ends here; bytes after it (a recycled file's old contents) mean nothing."""


Record = PutRecord | AckRecord | DropRecord | PriorityRecord | SnapshotRecord | SealRecord

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


class CorruptRecord(Exception):
    """A record that fails its checks (torn write, bad checksum, wrong magic, bad header)."""


def encode_record(
    header: Record, payload: Sequence[Frame] = (), *, seed: int
) -> tuple[list[memoryview | bytes], int]:
    """The iovecs of one record of segment `seed` and their total length. Payload frames are
    not copied."""
    head = _encoder.encode(header)
    views = [frame_bytes(f) for f in payload]
    payload_len = sum(v.nbytes for v in views)
    digest = xxhash.xxh3_64(LENGTHS.pack(len(head), payload_len), seed=seed)
    digest.update(head)
    for v in views:
        digest.update(v)
    prefix = PREFIX.pack(MAGIC, len(head), payload_len, digest.intdigest())
    return [prefix, head, *views], PREFIX.size + len(head) + payload_len


def write_all(fd: int, buffers: list[memoryview | bytes]) -> int:
    """writev every buffer completely (in IOV_MAX chunks, resuming after short writes)."""
    written = 0
    pending = [memoryview(b).cast("B") for b in buffers if len(b)]
    while pending:
        n = os.writev(fd, pending[:IOV_MAX])
        written += n
        while n:
            if n >= pending[0].nbytes:
                n -= pending[0].nbytes
                pending.pop(0)
            else:
                pending[0] = pending[0][n:]
                n = 0
    return written


def read_record(fh, max_bytes: int, *, seed: int) -> tuple[Record, memoryview, int] | None:
    """The next record of an open segment numbered `seed`: (header, payload, bytes read), or
    None at a clean end of file. Raises CorruptRecord for anything else."""
    prefix = fh.read(PREFIX.size)
    if not prefix:
        return None
    if len(prefix) < PREFIX.size:
        raise CorruptRecord(f"truncated record prefix ({len(prefix)} bytes)")
    magic, head_len, payload_len, checksum = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise CorruptRecord(f"bad magic {magic!r}")
    if head_len + payload_len > max_bytes:
        raise CorruptRecord(f"record of {head_len + payload_len} bytes is larger than the file allows")
    body = bytearray(head_len + payload_len)
    got = fh.readinto(body)
    if got != len(body):
        raise CorruptRecord(f"truncated record: {got} of {len(body)} bytes")
    digest = xxhash.xxh3_64(LENGTHS.pack(head_len, payload_len), seed=seed)
    digest.update(body)
    if digest.intdigest() != checksum:
        raise CorruptRecord("checksum mismatch")
    view = memoryview(body)
    try:
        header = _decoder.decode(view[:head_len])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise CorruptRecord(f"bad record header: {e}") from None
    return header, view[head_len:], PREFIX.size + len(body)


def split_group_frames(groups: Sequence[LoggedGroup], payload: memoryview) -> list[list[list[memoryview]]]:
    """Slice a PUT record's payload into per-group, per-trajectory frames (views, no copies)."""
    out = []
    offset = 0
    for group in groups:
        per_traj = []
        for meta in group.trajs:
            frames = []
            for spec in meta.arrays:
                n = math.prod(spec.shape) * DTYPES[spec.dtype]
                frames.append(payload[offset : offset + n])
                offset += n
            per_traj.append(frames)
        out.append(per_traj)
    if offset != payload.nbytes:
        raise CorruptRecord(f"PUT record payload is {payload.nbytes} bytes, its specs need {offset}")
    return out
