"""The durable log of one shard: append-only segment files, fsync policy, recovery, compaction.

Files in the shard's log directory: `<n>.seg` (n increasing, 12 digits). Records are appended
to the newest segment; past `segment_bytes` it is sealed (a SEAL record), closed, and the next
one started. Segments that compaction retires are kept (`<n>.free`, enough to hold what is written between
two compactions: `compact_min_bytes / segment_bytes + 2` files) and reused for new segments,
overwritten from the start: on this class of machine writing
pages already in the page cache costs ~0.2 CPU s/GB, new pages ~2.9 (measured), so recycling
makes the log several times cheaper in steady state. A record's checksum is seeded with its
segment's number, so what a recycled file held before is never mistaken for records.

What is logged, and why that is enough to rebuild the shard (see `recover`):
- PUT: the stored groups with their frames (and, replay, the seqs the PUT evicted). Written
  before the PUT is answered, so an acknowledged trajectory is in the log.
- ACK: the lease id and the seqs it deleted. Written before the ACK is answered, so an
  acknowledged consumption never comes back.
- DROP (stale) and PRIORITY (replay). Leases and NACKs are not logged: after a restart every
  leased group is simply queued again.
The state at any point is therefore: groups PUT and not ACKed, dropped or evicted since the
last snapshot.

fsync policy (`buffer.fsync`): every policy has written (write(2)) each record before the
reply that depends on it is sent, so a killed shard loses nothing it acknowledged; `always`
also fsyncs before those replies (one fsync per batch of requests served together: group
commit), `interval` fsyncs at most `fsync_interval_ms` later, `none` leaves it to the OS.

Compaction keeps the log bounded: when it outgrows `compact_ratio` times the bytes still held
(and `compact_min_bytes`), the shard captures its live state, starts a new segment for further
writes, and a background thread writes the captured state as a snapshot segment numbered just
before it (tmp file, fsync, rename, fsync dir). Once it is in place the older segments are
retired. Recovery starts from the newest snapshot segment; a crash at any step leaves either
the old segments (still complete) or the snapshot. Recovery reads each segment up to its SEAL;
the last segment may end without one (the shard died): it ends at its first bad record (a torn
write), and recovery seals it there.
"""

from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from buffer.dedupe import id_hash
from buffer.groups import Group, PreparedPut, StoredTrajectory
from buffer.log_records import (
    AckRecord,
    CorruptRecord,
    DropRecord,
    LoggedGroup,
    PriorityRecord,
    PutRecord,
    Record,
    SealRecord,
    SnapshotRecord,
    encode_record,
    read_record,
    split_group_frames,
    write_all,
)
from sluice.config.buffer import BufferConfig

log = logging.getLogger(__name__)

SNAPSHOT_RECORD_BYTES = 64 << 20  # groups per PUT record of a snapshot, by payload bytes


class LogWriteError(OSError):
    """A record could not be written; nothing of it remains in the log."""


class LogCorrupt(RuntimeError):
    """A record in the middle of the log is damaged: refusing to guess what was acknowledged."""


@dataclass
class RecoveredState:
    groups: list[Group] = field(default_factory=list)  # live, in seq order
    priorities: dict[int, float] = field(default_factory=dict)
    next_seq: int = 0
    seen_hashes: list[np.ndarray] = field(default_factory=list)  # dedupe window, oldest first
    settled: dict[str, int] = field(default_factory=dict)  # ACKed lease ids -> trajectories
    records: int = 0
    truncated_bytes: int = 0  # torn tail cut off the last segment


@dataclass
class Snapshot:
    """What compaction writes: the live state captured at one moment by the shard's thread."""

    groups: list[Group]
    priorities: dict[int, float]
    next_seq: int
    seen: np.ndarray
    settled: dict[str, int]


class ExperienceLog(ABC):
    """What the shard server needs from its log; `NoLog` when durability is off."""

    @abstractmethod
    def recover(self) -> RecoveredState: ...

    @abstractmethod
    def append_put(self, prepared: PreparedPut) -> None: ...

    @abstractmethod
    def append_ack(self, lease_id: str, seqs: list[int]) -> None: ...

    @abstractmethod
    def append_drop(self, seqs: list[int]) -> None: ...

    @abstractmethod
    def append_priorities(self, seqs: Sequence[int], priorities: Sequence[float]) -> None: ...

    @abstractmethod
    def commit(self) -> None:
        """Make what was appended as durable as the policy promises before replies go out."""

    @abstractmethod
    def tick(self, now: float, live_bytes: int, snapshot) -> None:
        """Timed work: interval fsync, starting and finishing compaction."""

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def stats(self) -> dict[str, int]: ...


class NoLog(ExperienceLog):
    """Durability off (`buffer.durable: false`): nothing survives a restart."""

    def recover(self) -> RecoveredState:
        return RecoveredState()

    def append_put(self, prepared: PreparedPut) -> None:
        pass

    def append_ack(self, lease_id: str, seqs: list[int]) -> None:
        pass

    def append_drop(self, seqs: list[int]) -> None:
        pass

    def append_priorities(self, seqs: Sequence[int], priorities: Sequence[float]) -> None:
        pass

    def commit(self) -> None:
        pass

    def tick(self, now: float, live_bytes: int, snapshot) -> None:
        pass

    def close(self) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {}


def _segment_name(n: int) -> str:
    return f"{n:012d}.seg"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def recycle_keep(cfg: BufferConfig) -> int:
    """Retired segment files kept for reuse: what the log writes between two compactions."""
    return cfg.compact_min_bytes // cfg.segment_bytes + 2


def _record_bytes(record: Record, seed: int) -> bytes:
    return b"".join(bytes(b) for b in encode_record(record, seed=seed)[0])


class SegmentLog(ExperienceLog):
    def __init__(self, directory: Path, cfg: BufferConfig) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cfg = cfg
        self.segments: list[int] = []  # numbers of closed segments still in the log
        self.segment_bytes: dict[int, int] = {}  # their valid length (a recycled file may be longer)
        self.pool: list[Path] = []  # retired segment files waiting to be reused
        self.pool_max = recycle_keep(cfg)
        self.active: int | None = None
        self.fd = -1
        self.active_bytes = 0
        self.dirty = False
        self.broken: str | None = None
        self.last_sync = time.monotonic()
        self._executor: ThreadPoolExecutor | None = None
        self._compaction: tuple[Future, int] | None = None  # (future, last segment it replaces)
        self._compact_retry_at = 0.0
        self.counters = {
            "log_records": 0,
            "log_written_bytes": 0,
            "fsyncs": 0,
            "compactions": 0,
            "compaction_errors": 0,
            "log_write_errors": 0,
            "log_recycled": 0,
        }

    # -- recovery ------------------------------------------------------------------------------

    def recover(self) -> RecoveredState:
        """Rebuild the state from the segments on disk, then open a fresh segment for writes."""
        for tmp in self.dir.glob("*.tmp"):
            tmp.unlink()
        self.pool = sorted(self.dir.glob("*.free"))
        numbers = sorted(int(p.stem) for p in self.dir.glob("*.seg"))
        start = self._newest_snapshot(numbers)
        for n in [n for n in numbers if n < start]:
            self._retire(n)  # replaced by a snapshot: finish that cleanup
        numbers = [n for n in numbers if n >= start]
        state = RecoveredState()
        live: dict[int, Group] = {}
        for i, n in enumerate(numbers):
            self.segment_bytes[n] = self._replay_segment(n, live, state, last=i == len(numbers) - 1)
        state.groups = [live[s] for s in sorted(live)]
        state.priorities = {s: p for s, p in state.priorities.items() if s in live}
        self.segments = numbers
        self._open_segment(
            (max([*numbers, *(int(p.stem) for p in self.pool)]) + 1) if numbers or self.pool else 1
        )
        if numbers:
            log.info(
                "recovered %d groups (%d records, %d segments) from %s",
                len(state.groups),
                state.records,
                len(numbers),
                self.dir,
            )
        return state

    def _newest_snapshot(self, numbers: list[int]) -> int:
        for n in reversed(numbers):
            path = self.dir / _segment_name(n)
            try:
                with path.open("rb") as fh:
                    first = read_record(fh, path.stat().st_size, seed=n)
            except CorruptRecord:
                continue
            if first is not None and isinstance(first[0], SnapshotRecord):
                return n
        return numbers[0] if numbers else 0

    def _replay_segment(self, n: int, live: dict[int, Group], state: RecoveredState, last: bool) -> int:
        """Fold segment `n` into the state; returns its valid length (sealing it if it had no seal)."""
        path = self.dir / _segment_name(n)
        size = path.stat().st_size
        offset = 0
        with path.open("rb") as fh:
            while True:
                try:
                    item = read_record(fh, size - offset, seed=n)
                    if item is not None and not isinstance(item[0], SealRecord):
                        _apply(item[0], item[1], live, state)
                except CorruptRecord as e:
                    if not last:
                        raise LogCorrupt(f"{path} at byte {offset}: {e}") from None
                    log.warning(
                        "%s: the log ends at byte %d (%s): a torn or never-written tail", path, offset, e
                    )
                    state.truncated_bytes += size - offset
                    break
                if item is None:
                    break
                offset += item[2]
                if isinstance(item[0], SealRecord):
                    return offset
                state.records += 1
        return offset + self._seal_at(path, n, offset)

    def _seal_at(self, path: Path, n: int, offset: int) -> int:
        seal = _record_bytes(SealRecord(), seed=n)
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, seal, offset)
            if self.cfg.fsync != "none":
                os.fdatasync(fd)
        finally:
            os.close(fd)
        return len(seal)

    # -- appends -------------------------------------------------------------------------------

    def append_put(self, prepared: PreparedPut) -> None:
        record = PutRecord(
            groups=[LoggedGroup(seq=g.seq, trajs=g.metas) for g in prepared.groups],
            evicted=list(prepared.evicted),
        )
        self._append(record, [f for g in prepared.groups for f in g.frames])

    def append_ack(self, lease_id: str, seqs: list[int]) -> None:
        self._append(AckRecord(lease_id=lease_id, seqs=seqs))

    def append_drop(self, seqs: list[int]) -> None:
        if seqs:
            self._append(DropRecord(seqs=seqs))

    def append_priorities(self, seqs: Sequence[int], priorities: Sequence[float]) -> None:
        if seqs:
            self._append(PriorityRecord(seqs=list(seqs), priorities=[float(p) for p in priorities]))

    def _append(self, record: Record, payload: Sequence = (), roll: bool = True) -> None:
        if self.broken is not None:
            raise LogWriteError(f"log {self.dir} is unusable: {self.broken}")
        buffers, length = encode_record(record, payload, seed=self.active)
        try:
            write_all(self.fd, buffers)
        except OSError as e:
            self.counters["log_write_errors"] += 1
            try:
                os.ftruncate(self.fd, self.active_bytes)
                os.lseek(self.fd, self.active_bytes, os.SEEK_SET)
            except OSError as e2:
                self.broken = f"write failed ({e}) and the partial record could not be cut ({e2})"
            raise LogWriteError(f"log {self.dir}: {e}") from e
        self.active_bytes += length
        self.counters["log_records"] += 1
        self.counters["log_written_bytes"] += length
        self.dirty = True
        if roll and self.active_bytes >= self.cfg.segment_bytes:
            self._roll()

    # -- durability ----------------------------------------------------------------------------

    def commit(self) -> None:
        if self.cfg.fsync == "always" and self.dirty:
            self._sync()

    def _sync(self) -> None:
        os.fdatasync(self.fd)
        self.dirty = False
        self.last_sync = time.monotonic()
        self.counters["fsyncs"] += 1

    def tick(self, now: float, live_bytes: int, snapshot) -> None:
        """`snapshot` is a callable returning a Snapshot of the shard's state (called only when
        a compaction starts)."""
        if (
            self.cfg.fsync == "interval"
            and self.dirty
            and (now - self.last_sync) * 1000 >= self.cfg.fsync_interval_ms
        ):
            self._sync()
        if self._compaction is not None:
            if self._compaction[0].done():
                self._finish_compaction()
        elif now >= self._compact_retry_at and self.total_bytes > max(
            self.cfg.compact_min_bytes, self.cfg.compact_ratio * live_bytes
        ):
            self._start_compaction(snapshot())

    # -- segments ------------------------------------------------------------------------------

    @property
    def total_bytes(self) -> int:
        return sum(self.segment_bytes.values()) + self.active_bytes

    def _take_file(self, path: Path) -> None:
        """Put a retired file (if any) at `path`, to be overwritten from its start."""
        if self.pool:
            os.rename(self.pool.pop(), path)
            self.counters["log_recycled"] += 1

    def _retire(self, n: int) -> None:
        """Segment `n` left the log: keep its file for reuse, or delete it."""
        path = self.dir / _segment_name(n)
        if len(self.pool) < self.pool_max:
            free = self.dir / f"{n:012d}.free"
            os.rename(path, free)
            self.pool.append(free)
        else:
            path.unlink(missing_ok=True)

    def _open_segment(self, n: int) -> None:
        path = self.dir / _segment_name(n)
        self._take_file(path)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)  # no O_TRUNC: keep cached pages
        self.active = n
        self.active_bytes = 0
        if self.cfg.fsync != "none":
            _fsync_dir(self.dir)

    def _close_active(self) -> None:
        if self.fd < 0:
            return
        self._append(SealRecord(), roll=False)
        if self.cfg.fsync != "none":
            self._sync()
        os.close(self.fd)
        self.fd = -1
        self.segments.append(self.active)
        self.segment_bytes[self.active] = self.active_bytes
        self.active_bytes = 0
        self.dirty = False

    def _roll(self, skip: int = 0) -> None:
        """Seal and close the active segment and open the next (leaving `skip` numbers unused)."""
        n = self.active
        self._close_active()
        self._open_segment(n + 1 + skip)

    # -- compaction ----------------------------------------------------------------------------

    def _start_compaction(self, snap: Snapshot) -> None:
        replaces = self.active
        self._roll(skip=1)  # writes go on in replaces + 2; the snapshot becomes replaces + 1
        tmp = self.dir / (_segment_name(replaces + 1) + ".tmp")
        self._take_file(tmp)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compaction")
        future = self._executor.submit(self._write_snapshot, replaces + 1, tmp, snap)
        self._compaction = (future, replaces)

    def _write_snapshot(self, n: int, tmp: Path, snap: Snapshot) -> int:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o644)
        written = 0
        try:
            record = SnapshotRecord(next_seq=snap.next_seq, settled=snap.settled)
            written += write_all(fd, encode_record(record, [snap.seen.tobytes()], seed=n)[0])
            batch: list[Group] = []
            batch_bytes = 0
            for group in snap.groups:
                batch.append(group)
                batch_bytes += group.nbytes
                if batch_bytes >= SNAPSHOT_RECORD_BYTES:
                    written += self._write_groups(fd, batch, n)
                    batch, batch_bytes = [], 0
            if batch:
                written += self._write_groups(fd, batch, n)
            if snap.priorities:
                seqs = list(snap.priorities)
                record = PriorityRecord(seqs=seqs, priorities=[snap.priorities[s] for s in seqs])
                written += write_all(fd, encode_record(record, seed=n)[0])
            written += write_all(fd, encode_record(SealRecord(), seed=n)[0])
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, self.dir / _segment_name(n))
        _fsync_dir(self.dir)
        return written

    @staticmethod
    def _write_groups(fd: int, groups: list[Group], n: int) -> int:
        record = PutRecord(groups=[LoggedGroup(seq=g.seq, trajs=g.metas) for g in groups])
        return write_all(fd, encode_record(record, [f for g in groups for f in g.frames], seed=n)[0])

    def _finish_compaction(self) -> None:
        future, replaces = self._compaction
        self._compaction = None
        try:
            written = future.result()
        except Exception:  # noqa: BLE001 - the old segments are intact; retry later
            log.exception("compaction of %s failed; keeping the uncompacted log", self.dir)
            self.counters["compaction_errors"] += 1
            self._compact_retry_at = time.monotonic() + 30.0
            for tmp in self.dir.glob("*.tmp"):
                tmp.unlink(missing_ok=True)
            return
        for n in [n for n in self.segments if n <= replaces]:
            self.segments.remove(n)
            del self.segment_bytes[n]
            self._retire(n)
        self.segments = sorted([*self.segments, replaces + 1])
        self.segment_bytes[replaces + 1] = written
        self.counters["compactions"] += 1

    def wait_for_compaction(self) -> None:
        """Block until a running compaction is done and cleaned up (tests, shutdown)."""
        if self._compaction is not None:
            self._compaction[0].exception()
            self._finish_compaction()

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        self.wait_for_compaction()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self.fd >= 0 and self.broken is None:
            self._close_active()
        elif self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def stats(self) -> dict[str, int]:
        return self.counters | {
            "log_bytes": self.total_bytes,
            "log_segments": len(self.segments) + (self.fd >= 0),
        }


def _apply(record: Record, payload: memoryview, live: dict[int, Group], state: RecoveredState) -> None:
    """Fold one record into the state being recovered."""
    if isinstance(record, PutRecord):
        per_group = split_group_frames(record.groups, payload)
        for logged, frames in zip(record.groups, per_group):
            trajs = [
                StoredTrajectory(meta=m, frames=f, nbytes=sum(v.nbytes for v in f))
                for m, f in zip(logged.trajs, frames)
            ]
            if not trajs:
                raise CorruptRecord(f"PUT record group seq {logged.seq} has no trajectories")
            first = logged.trajs[0]
            version = min(m.version for m in logged.trajs)
            live[logged.seq] = Group(logged.seq, first.group_id, first.policy_id, version, trajs)
            state.next_seq = max(state.next_seq, logged.seq + 1)
            state.seen_hashes.append(
                np.fromiter((id_hash(m.traj_id) for m in logged.trajs), np.uint64, len(logged.trajs))
            )
        for seq in record.evicted:
            live.pop(seq, None)
    elif isinstance(record, AckRecord):
        count = sum(live.pop(seq).size for seq in record.seqs if seq in live)
        state.settled[record.lease_id] = count
    elif isinstance(record, DropRecord):
        for seq in record.seqs:
            live.pop(seq, None)
    elif isinstance(record, PriorityRecord):
        for seq, p in zip(record.seqs, record.priorities):
            state.priorities[seq] = p
    elif isinstance(record, SnapshotRecord):
        live.clear()
        state.priorities.clear()
        state.seen_hashes = [np.frombuffer(payload, dtype=np.uint64)]
        state.settled = dict(record.settled)
        state.next_seq = record.next_seq


def build_log(cfg: BufferConfig, directory: Path | None) -> ExperienceLog:
    """SegmentLog in `directory`, or NoLog when there is none (durability off)."""
    return NoLog() if directory is None else SegmentLog(directory, cfg)
