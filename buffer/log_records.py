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
Payload frames are written straight from the received ZeroMQ frames with `os.pwritev`: the
log path copies no array bytes in user space.

A REGION record (magic b"SLR1") is space reserved for a same-host producer, which writes the
payload itself: its checksum covers the lengths and the header only, and a reader skips its
payload unread. Its bytes count only once a PUT record names the region (`PutRecord.region`)
with the xxh3-64 of its contents, checked when the shard stored it and again at recovery: a
producer that died while writing leaves a region no record names, which means nothing.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Sequence
from typing import NamedTuple

import msgspec
import xxhash

from sluice.wire.codec import DTYPES, Frame, frame_bytes
from sluice.wire.messages import TrajectoryMeta

MAGIC = b"SLG1"
REGION_MAGIC = b"SLR1"
REGION_ALIGN = 64  # a region's first byte (and each trajectory in it) starts at a multiple of this
PREFIX = struct.Struct("<4sIQQ")
LENGTHS = struct.Struct("<IQ")
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


class LoggedGroup(msgspec.Struct, forbid_unknown_fields=True):
    seq: int
    trajs: list[TrajectoryMeta]


class PutRecord(msgspec.Struct, tag_field="kind", tag="put", forbid_unknown_fields=True):
    """Groups stored by a PUT (their frames are the payload, or lie in a region of the same
    segment) and the groups it evicted (replay)."""

    groups: list[LoggedGroup]
    evicted: list[int] = []
    region: list[int] = []  # [offset, nbytes, xxh3-64 (seed 0)] of the region holding the payload
    traj_at: list[int] = []  # with a region: file offset of each trajectory's first array, in order


class RegionRecord(msgspec.Struct, tag_field="kind", tag="region", forbid_unknown_fields=True):
    """Space reserved for a same-host producer; the payload that follows is what it wrote."""

    pad: bytes = b""  # aligns the region's first byte to REGION_ALIGN


class AckRecord(msgspec.Struct, tag_field="kind", tag="ack", forbid_unknown_fields=True):
    """A lease was ACKed: its groups are gone for good."""

    lease_id: str
    seqs: list[int]


class LeaseRecord(msgspec.Struct, tag_field="kind", tag="lease", forbid_unknown_fields=True):
    """Groups a GET leased (fifo). A restarted shard restores the lease, with a fresh deadline,
    so its holder's ACK still finds it instead of the groups being delivered again."""

    lease_id: str
    seqs: list[int]
    holder: str = ""
    incarnation: str = ""


class UnleaseRecord(msgspec.Struct, tag_field="kind", tag="unlease", forbid_unknown_fields=True):
    """Leases that ended without an ACK (NACK, expiry, a takeover): their groups are queued."""

    lease_ids: list[str]


class DropRecord(msgspec.Struct, tag_field="kind", tag="drop", forbid_unknown_fields=True):
    """Groups dropped for staleness."""

    seqs: list[int]


class PriorityRecord(msgspec.Struct, tag_field="kind", tag="priority", forbid_unknown_fields=True):
    """New raw priorities of replay groups."""

    seqs: list[int]
    priorities: list[float]


class SnapshotRecord(msgspec.Struct, tag_field="kind", tag="snapshot", forbid_unknown_fields=True):
    """First record of a compacted segment: the log begins at segment `resumes_at` (segments
    before it are gone), and this record states what they held: the dedupe window's hashes
    (uint64, the payload), the next seq and the settled leases. The live groups that lay
    before `resumes_at` follow as PUT (and PRIORITY, LEASE) records; those from `resumes_at`
    on stayed where they were (None: this segment itself, every live group follows)."""

    next_seq: int
    settled: dict[str, int] = {}  # recently ACKed lease ids -> trajectories
    resumes_at: int | None = None


class SealRecord(msgspec.Struct, tag_field="kind", tag="seal", forbid_unknown_fields=True):
    """The segment ends here; bytes after it (a recycled file's old contents) mean nothing."""


Record = (
    PutRecord
    | AckRecord
    | LeaseRecord
    | UnleaseRecord
    | DropRecord
    | PriorityRecord
    | SnapshotRecord
    | SealRecord
    | RegionRecord
)

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


def encode_region(nbytes: int, at: int, *, seed: int) -> tuple[bytes, int]:
    """Prefix + header of a REGION record written at file offset `at`, and the offset of the
    region's first byte (a multiple of REGION_ALIGN). The region's bytes are not covered."""
    head = _encoder.encode(RegionRecord())
    pad = -(at + PREFIX.size + len(head)) % REGION_ALIGN
    if pad:
        head = _encoder.encode(RegionRecord(pad=bytes(pad)))
    digest = xxhash.xxh3_64(LENGTHS.pack(len(head), nbytes), seed=seed)
    digest.update(head)
    prefix = PREFIX.pack(REGION_MAGIC, len(head), nbytes, digest.intdigest())
    return prefix + head, at + PREFIX.size + len(head)


def region_layout(traj_nbytes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of trajectories in a region (each at a multiple of REGION_ALIGN, its arrays
    back to back) and the region's size."""
    offsets = []
    end = 0
    for n in traj_nbytes:
        end += -end % REGION_ALIGN
        offsets.append(end)
        end += n
    return offsets, end


def write_all(fd: int, buffers: Sequence[memoryview | bytes], offset: int | None = None) -> int:
    """Write every buffer completely (in IOV_MAX chunks, resuming after short writes): at the
    file position (writev), or from `offset` (pwritev)."""
    written = 0
    pending = [memoryview(b).cast("B") for b in buffers if len(b)]
    while pending:
        if offset is None:
            n = os.writev(fd, pending[:IOV_MAX])
        else:
            n = os.pwritev(fd, pending[:IOV_MAX], offset + written)
        written += n
        while n:
            if n >= pending[0].nbytes:
                n -= pending[0].nbytes
                pending.pop(0)
            else:
                pending[0] = pending[0][n:]
                n = 0
    return written


class ReadRecord(NamedTuple):
    record: Record
    payload: memoryview  # empty for a REGION record (its bytes are skipped, unread)
    size: int  # bytes of the whole record
    payload_at: int  # offset of the payload from the record's first byte


def read_record(fh, max_bytes: int, *, seed: int) -> ReadRecord | None:
    """The next record of an open segment numbered `seed`, or None at a clean end of file.
    Raises CorruptRecord for anything else."""
    prefix = fh.read(PREFIX.size)
    if not prefix:
        return None
    if len(prefix) < PREFIX.size:
        raise CorruptRecord(f"truncated record prefix ({len(prefix)} bytes)")
    magic, head_len, payload_len, checksum = PREFIX.unpack(prefix)
    if magic not in (MAGIC, REGION_MAGIC):
        raise CorruptRecord(f"bad magic {magic!r}")
    if head_len + payload_len > max_bytes:
        raise CorruptRecord(f"record of {head_len + payload_len} bytes is larger than the file allows")
    if magic == REGION_MAGIC:
        return _read_region(fh, head_len, payload_len, checksum, seed)
    body = bytearray(head_len + payload_len)
    got = fh.readinto(body)
    if got != len(body):
        raise CorruptRecord(f"truncated record: {got} of {len(body)} bytes")
    digest = xxhash.xxh3_64(LENGTHS.pack(head_len, payload_len), seed=seed)
    digest.update(body)
    if digest.intdigest() != checksum:
        raise CorruptRecord("checksum mismatch")
    view = memoryview(body)
    header = _decode_header(view[:head_len])
    if isinstance(header, RegionRecord):
        raise CorruptRecord("a region header inside an ordinary record")
    return ReadRecord(header, view[head_len:], PREFIX.size + len(body), PREFIX.size + head_len)


def _read_region(fh, head_len: int, payload_len: int, checksum: int, seed: int) -> ReadRecord:
    head = fh.read(head_len)
    if len(head) != head_len:
        raise CorruptRecord(f"truncated region header: {len(head)} of {head_len} bytes")
    digest = xxhash.xxh3_64(LENGTHS.pack(head_len, payload_len), seed=seed)
    digest.update(head)
    if digest.intdigest() != checksum:
        raise CorruptRecord("checksum mismatch")
    header = _decode_header(memoryview(head))
    if not isinstance(header, RegionRecord):
        raise CorruptRecord(f"region magic on a {type(header).__name__}")
    fh.seek(payload_len, os.SEEK_CUR)
    return ReadRecord(header, memoryview(b""), PREFIX.size + head_len + payload_len, PREFIX.size + head_len)


def _decode_header(raw: memoryview) -> Record:
    try:
        return _decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise CorruptRecord(f"bad record header: {e}") from None


def array_sizes(meta: TrajectoryMeta) -> list[int]:
    """Bytes of each array of a trajectory, in order."""
    return [math.prod(spec.shape) * DTYPES[spec.dtype] for spec in meta.arrays]


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
