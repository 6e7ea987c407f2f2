"""The durable log of one shard: append-only segment files, the fsync policy, recovery,
compaction with segment recycling, and the same-host regions and views kept in those files.
What it logs, why that suffices, and how compaction, recycling and regions work:
docs/architecture.md (Buffer: durability, compaction, same-host data plane); what a reply
promises under each `buffer.fsync`: docs/protocol.md.

The rules this module keeps: a record is written before the reply that depends on it is sent
(and fsynced first under `fsync: always`), so the log holds whatever anyone was told; files
are written at explicit offsets and never truncated (a mapped page never lies past its end);
recovery starts at the newest snapshot segment, reads each segment to its SEAL and the last
one to its first bad record, and rebuilds the groups PUT and not since ACKed, dropped or
evicted.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np

from sluice.buffer.dedupe import id_hash
from sluice.buffer.groups import Group, Loc, PreparedPut, StoredTrajectory
from sluice.buffer.log_cut import choose_cut, group_segment, live_bytes_by_segment
from sluice.buffer.log_reader import Where, put_groups
from sluice.buffer.log_records import (
    PREFIX,
    AckRecord,
    CorruptRecord,
    DropRecord,
    LeaseRecord,
    LoggedGroup,
    PriorityRecord,
    PutRecord,
    Record,
    RegionRecord,
    SealRecord,
    SnapshotRecord,
    UnleaseRecord,
    array_sizes,
    encode_record,
    encode_region,
    read_record,
    write_all,
)
from sluice.buffer.segment_maps import SegmentMaps, segment_name
from sluice.buffer.view_pins import ViewPins
from sluice.config.buffer import BufferConfig

log = logging.getLogger(__name__)

SNAPSHOT_RECORD_BYTES = 64 << 20  # groups per PUT record of a snapshot, by payload bytes
ARCHIVE_DIR = "archive"  # under a shard's log directory: the segments `buffer.archive` keeps


class LogWriteError(OSError):
    """A record could not be written; nothing of it remains in the log."""


class LogCorrupt(RuntimeError):
    """A record in the middle of the log is damaged: refusing to guess what was acknowledged."""


class NoSuchRegion(KeyError):
    """A PUT names a region this connection did not reserve (or that expired or was used)."""


@dataclass
class Reservation:
    """Space of a segment handed to one same-host producer for one PUT."""

    region: int  # random id, named by the PUT
    owner: bytes  # the ZeroMQ identity of the connection that reserved it
    segment: int
    offset: int  # file offset of the region's first byte
    nbytes: int
    deadline: float  # monotonic time after which it is abandoned


@dataclass
class RecoveredState:
    groups: list[Group] = field(default_factory=list)  # live, in seq order
    priorities: dict[int, float] = field(default_factory=dict)
    next_seq: int = 0
    seen_hashes: list[np.ndarray] = field(default_factory=list)  # dedupe window, oldest first
    settled: dict[str, int] = field(default_factory=dict)  # ACKed lease ids -> trajectories
    leases: dict[str, LeaseRecord] = field(default_factory=dict)  # held, with their live groups' seqs
    records: int = 0
    truncated_bytes: int = 0  # torn tail cut off the last segment


@dataclass
class Compaction:
    """A compaction under way: the snapshot segment being written, where the log will begin
    once it is (segments before `resumes_at` retire), and the live groups it copies."""

    future: Future
    snapshot: int
    resumes_at: int
    groups: list[Group]


@dataclass
class Snapshot:
    """What compaction writes: the live state captured at one moment by the shard's thread."""

    groups: list[Group]
    priorities: dict[int, float]
    next_seq: int
    seen: np.ndarray
    settled: dict[str, int]
    leases: list[LeaseRecord] = field(default_factory=list)  # held now


class ExperienceLog(ABC):
    """What the shard server needs from its log; `NoLog` when durability is off and there is
    no same-host sharing."""

    shared_dir: Path | None = None  # segment files same-host clients may map (None: no sharing)
    pins: ViewPins

    @abstractmethod
    def recover(self) -> RecoveredState: ...

    def reserve(self, nbytes: int, owner: bytes, now: float) -> Reservation:
        raise LogWriteError("this shard keeps no segment files: no same-host PUT")

    def claim(self, region: int, owner: bytes) -> Reservation:
        raise NoSuchRegion(region)

    def fits_region(self, nbytes: int) -> bool:
        return False

    def region_bytes(self, res: Reservation) -> memoryview:
        raise LogWriteError("this shard keeps no segment files")

    def append_put_region(self, prepared: PreparedPut, res: Reservation, used: int, checksum: int) -> None:
        raise LogWriteError("this shard keeps no segment files")

    @property
    def reserved_bytes(self) -> int:
        return 0

    @abstractmethod
    def append_put(self, prepared: PreparedPut) -> None: ...

    @abstractmethod
    def append_ack(self, lease_id: str, seqs: list[int]) -> None: ...

    @abstractmethod
    def append_lease(self, record: LeaseRecord) -> None: ...

    @abstractmethod
    def append_unlease(self, lease_ids: list[str]) -> None: ...

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

    def __init__(self) -> None:
        self.pins = ViewPins()

    def recover(self) -> RecoveredState:
        return RecoveredState()

    def append_put(self, prepared: PreparedPut) -> None:
        pass

    def append_ack(self, lease_id: str, seqs: list[int]) -> None:
        pass

    def append_lease(self, record: LeaseRecord) -> None:
        pass

    def append_unlease(self, lease_ids: list[str]) -> None:
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


_segment_name = segment_name


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def recycle_keep(cfg: BufferConfig, retired_last: int = 0) -> int:
    """Retired segment files kept for reuse: what the log writes between two compactions, at
    least what one compaction retired (a log holding much compacts at twice that). Writing into
    a reused file's cached pages costs a tenth of the CPU of fresh ones (docs/scaling.md, "A
    buffer shard"), and the pool never holds more than the log's largest size did."""
    return max(cfg.compact_min_bytes // cfg.segment_bytes + 2, retired_last)


def _record_bytes(record: Record, seed: int) -> bytes:
    return b"".join(bytes(b) for b in encode_record(record, seed=seed)[0])


class SegmentLog(ExperienceLog):
    def __init__(self, directory: Path, cfg: BufferConfig, *, ephemeral: bool = False) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cfg = cfg
        self.ephemeral = ephemeral  # memory-backed segments for same-host sharing, no recovery
        self.fsync = "none" if ephemeral else cfg.fsync
        self.shared_dir = self.dir.resolve() if cfg.same_host_transport == "auto" else None
        self.maps = SegmentMaps(self.dir, keep=16)
        self.pins = ViewPins()
        self.reservations: dict[int, Reservation] = {}
        self._reserved_bytes = 0
        self.retiring: list[int] = []  # out of the log, waiting until no reader may need them
        self.tainted: set[int] = set()  # segments a producer may still write: delete, never reuse
        self.segments: list[int] = []  # numbers of closed segments still in the log
        self.segment_bytes: dict[int, int] = {}  # their valid length (a recycled file may be longer)
        self.pool: list[Path] = []  # retired segment files waiting to be reused
        self.pool_max = recycle_keep(cfg)
        # buffer.archive: retired segments are kept there, never reused (docs/architecture.md)
        self.archive = self.dir / ARCHIVE_DIR if cfg.archive and not ephemeral else None
        self.active = 0  # number of the segment writes go to (0: none until recover opens one)
        self.fd = -1
        self.active_bytes = 0
        self.dirty = False
        self.last_sync = time.monotonic()
        self._executor: ThreadPoolExecutor | None = None
        self._compaction: Compaction | None = None
        self._compact_retry_at = 0.0
        self.counters = {
            "log_records": 0,
            "log_written_bytes": 0,
            "fsyncs": 0,
            "compactions": 0,
            "compacted_bytes": 0,
            "compaction_retired_bytes": 0,
            "compaction_errors": 0,
            "log_write_errors": 0,
            "log_recycled": 0,
            "region_puts": 0,
            "region_bytes": 0,
            "region_copies": 0,
            "reservations_expired": 0,
        }

    # -- recovery ------------------------------------------------------------------------------

    def recover(self) -> RecoveredState:
        """Rebuild the state from the segments on disk, then open a fresh segment for writes.
        Ephemeral: forget whatever is there and start empty."""
        if self.ephemeral:
            for path in self.dir.iterdir():
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
            self._open_segment(1)
            return RecoveredState()
        for tmp in self.dir.glob("*.tmp"):
            tmp.unlink()
        self.pool = sorted(self.dir.glob("*.free"))
        numbers = sorted(int(p.stem) for p in self.dir.glob("*.seg"))
        snapshot, start = self._newest_snapshot(numbers)
        for n in [n for n in numbers if n < start]:
            self._retire(n)  # cut off by a compaction: finish that cleanup
        numbers = [n for n in numbers if n >= start]
        state = RecoveredState()
        live: dict[int, Group] = {}
        for i, n in enumerate(numbers):
            last = i == len(numbers) - 1
            self.segment_bytes[n] = self._replay_segment(n, live, state, last=last, full=n >= snapshot)
        state.groups = [live[s] for s in sorted(live)]
        state.priorities = {s: p for s, p in state.priorities.items() if s in live}
        state.leases = held_leases(state.leases, live)
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

    def _newest_snapshot(self, numbers: list[int]) -> tuple[int, int]:
        """The newest snapshot segment and the segment the log begins at (its `resumes_at`)."""
        for n in reversed(numbers):
            path = self.dir / _segment_name(n)
            try:
                with path.open("rb") as fh:
                    first = read_record(fh, path.stat().st_size, seed=n)
            except CorruptRecord:
                continue
            record = first.record if first is not None else None
            if isinstance(record, SnapshotRecord):
                return n, n if record.resumes_at is None else record.resumes_at
        start = numbers[0] if numbers else 0
        return start, start

    def _replay_segment(
        self, n: int, live: dict[int, Group], state: RecoveredState, last: bool, full: bool = True
    ) -> int:
        """Fold segment `n` into the state; returns its valid length (sealing it if it had no seal).
        Not `full`: a segment before the newest snapshot, whose SNAPSHOT record states the
        dedupe window, settled leases and next seq as of after it: only its groups count."""
        path = self.dir / _segment_name(n)
        size = path.stat().st_size
        offset = 0
        sealed = False
        unclaimed: set[int] = set()  # regions no PUT record names
        with path.open("rb") as fh:
            while True:
                try:
                    item = read_record(fh, size - offset, seed=n)
                    if item is None:
                        break
                    if isinstance(item.record, RegionRecord):
                        unclaimed.add(offset + item.payload_at)
                    elif not isinstance(item.record, SealRecord):
                        where = Where(n, offset + item.payload_at, fh.fileno(), offset)
                        _apply(item.record, item.payload, live, state, where, full)
                        if isinstance(item.record, PutRecord) and item.record.region:
                            unclaimed.discard(item.record.region[0])
                except CorruptRecord as e:
                    if not last:
                        raise LogCorrupt(f"{path} at byte {offset}: {e}") from None
                    log.warning(
                        "%s: the log ends at byte %d (%s): a torn or never-written tail", path, offset, e
                    )
                    state.truncated_bytes += size - offset
                    self.tainted.add(n)  # perhaps a region a producer was still writing
                    break
                offset += item.size
                if isinstance(item.record, SealRecord):
                    sealed = True
                    break
                state.records += 1
        if unclaimed:
            self.tainted.add(n)  # a producer may still write there: never reuse the file
        return offset if sealed else offset + self._seal_at(path, n, offset)

    def _seal_at(self, path: Path, n: int, offset: int) -> int:
        seal = _record_bytes(SealRecord(), seed=n)
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, seal, offset)
            if self.fsync != "none":
                os.fdatasync(fd)
        finally:
            os.close(fd)
        return len(seal)

    # -- appends -------------------------------------------------------------------------------

    def append_put(self, prepared: PreparedPut) -> None:
        """A PUT that came with its payload frames (ZeroMQ): logged with them (ephemeral: kept
        in memory only)."""
        if not self.ephemeral:
            self._write_inline(prepared)

    def _write_inline(self, prepared: PreparedPut) -> None:
        """Log the groups with their bytes in the record and point them there."""
        record = PutRecord(
            groups=[LoggedGroup(seq=g.seq, trajs=g.metas) for g in prepared.groups],
            evicted=list(prepared.evicted),
        )
        segment, at = self._append(record, [f for g in prepared.groups for f in g.frames])
        for group in prepared.groups:
            for t in group.trajs:
                self._move(t, (segment, at))
                at += t.nbytes

    def fits_region(self, nbytes: int) -> bool:
        """A region of `nbytes` fits the active segment: reserving it would not roll the log."""
        return self.active_bytes == 0 or self.active_bytes + nbytes + 256 <= self.cfg.segment_bytes

    def reserve(self, nbytes: int, owner: bytes, now: float) -> Reservation:
        """Space for a same-host producer's PUT in the active segment (a REGION record)."""
        if not self.fits_region(nbytes):
            self._roll()  # start the region in a fresh segment rather than overfill this one
        head, data_at = encode_region(nbytes, self.active_bytes, seed=self.active)
        self._write(head, data_at + nbytes - self.active_bytes)
        self.counters["region_bytes"] += nbytes
        res = Reservation(
            region=secrets.randbits(62) + 1,
            owner=owner,
            segment=self.active,
            offset=data_at,
            nbytes=nbytes,
            deadline=now + self.cfg.reserve_timeout_s,
        )
        self.reservations[res.region] = res
        self._reserved_bytes += nbytes
        return res

    def claim(self, region: int, owner: bytes) -> Reservation:
        """The reservation a PUT names, now used up (NoSuchRegion if this connection holds none
        by that id). Once its PUT arrived the producer has stopped writing it."""
        res = self.reservations.get(region)
        if res is None or res.owner != owner:
            raise NoSuchRegion(region)
        del self.reservations[region]
        self._reserved_bytes -= res.nbytes
        return res

    def region_bytes(self, res: Reservation) -> memoryview:
        """What the producer wrote (SegmentGone if the file does not even reach its end)."""
        return self.maps.view(res.segment, res.offset, res.nbytes)

    def append_put_region(self, prepared: PreparedPut, res: Reservation, used: int, checksum: int) -> None:
        """Log a PUT whose payload a same-host producer wrote into the first `used` bytes of
        `res` (checked against `checksum` by the caller); its trajectories' frames are views of
        the region."""
        self.counters["region_puts"] += 1
        if res.segment != self.active:
            self.counters["region_copies"] += 1
            self._write_inline(prepared)
            return
        if self.ephemeral:
            return
        record = PutRecord(
            groups=[LoggedGroup(seq=g.seq, trajs=g.metas) for g in prepared.groups],
            evicted=list(prepared.evicted),
            region=[res.offset, used, checksum],
            traj_at=[t.logged_at()[1] for g in prepared.groups for t in g.trajs],
        )
        self._append(record)

    def views(self, t: StoredTrajectory) -> list[memoryview]:
        """Views of a trajectory's arrays where the log holds them (`t.loc`)."""
        segment, offset = t.logged_at()
        data = self.maps.view(segment, offset, t.nbytes)
        out, at = [], 0
        for n in array_sizes(t.meta):
            out.append(data[at : at + n])
            at += n
        return out

    def _move(self, t: StoredTrajectory, loc: Loc) -> None:
        """The log now holds `t`'s arrays at `loc` (views of the old place are remade)."""
        t.loc = loc
        if t.mapped:
            t.frames = self.views(t)

    def append_ack(self, lease_id: str, seqs: list[int]) -> None:
        if not self.ephemeral:
            self._append(AckRecord(lease_id=lease_id, seqs=seqs))

    def append_lease(self, record: LeaseRecord) -> None:
        if not self.ephemeral:
            self._append(record)

    def append_unlease(self, lease_ids: list[str]) -> None:
        if lease_ids and not self.ephemeral:
            self._append(UnleaseRecord(lease_ids=lease_ids))

    def append_drop(self, seqs: list[int]) -> None:
        if seqs and not self.ephemeral:
            self._append(DropRecord(seqs=seqs))

    def append_priorities(self, seqs: Sequence[int], priorities: Sequence[float]) -> None:
        if seqs and not self.ephemeral:
            self._append(PriorityRecord(seqs=list(seqs), priorities=[float(p) for p in priorities]))

    def _append(self, record: Record, payload: Sequence = (), roll: bool = True) -> Loc:
        """Write a record at the end of the active segment. Returns (segment, file offset of its
        payload)."""
        buffers, length = encode_record(record, payload, seed=self.active)
        segment, payload_at = self.active, self.active_bytes + PREFIX.size + len(buffers[1])
        self._write(buffers, length)
        self.counters["log_records"] += 1
        if roll and self.active_bytes >= self.cfg.segment_bytes and not self._defer_roll():
            self._roll()
        return segment, payload_at

    def _defer_roll(self) -> bool:
        """Keep writing (small records) past segment_bytes while a region of the active segment
        is reserved and not yet PUT: rolling now would make its PUT copy it (see `reserve`).
        The next RESERVE that does not fit rolls (or, at twice the size, the next record)."""
        if self.active_bytes >= 2 * self.cfg.segment_bytes:
            return False
        return any(r.segment == self.active for r in self.reservations.values())

    def _write(self, buffers, length: int) -> None:
        """Write at the end of the active segment and count `length` bytes as taken (a region
        takes more than its header). A failed write leaves a partial record past the end that
        the next write overwrites (and recovery would read as a torn tail): no truncation,
        mapped files stay whole."""
        if isinstance(buffers, bytes):
            buffers = [buffers]
        try:
            written = write_all(self.fd, buffers, self.active_bytes)
        except OSError as e:
            self.counters["log_write_errors"] += 1
            raise LogWriteError(f"log {self.dir}: {e}") from e
        self.active_bytes += length
        self.counters["log_written_bytes"] += written
        self.dirty = True

    # -- durability ----------------------------------------------------------------------------

    def commit(self) -> None:
        if self.fsync == "always" and self.dirty:
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
            self.fsync == "interval"
            and self.dirty
            and (now - self.last_sync) * 1000 >= self.cfg.fsync_interval_ms
        ):
            self._sync()
        self._expire_reservations(now)
        if self._compaction is not None:
            if self._compaction.future.done():
                self._finish_compaction(self._compaction)
        elif now >= self._compact_retry_at and self.total_bytes > max(
            self.cfg.compact_min_bytes, self.cfg.compact_ratio * live_bytes
        ):
            self._start_compaction(snapshot())
        if self.retiring:
            self._retire_ready(now)

    def _expire_reservations(self, now: float) -> None:
        for res in [r for r in self.reservations.values() if r.deadline <= now]:
            del self.reservations[res.region]
            self._reserved_bytes -= res.nbytes
            self.tainted.add(res.segment)  # the producer may still write there, some day
            self.counters["reservations_expired"] += 1
            log.warning(
                "%s: reservation %d (%d bytes in segment %d) was not used within %.0fs: abandoned",
                self.dir,
                res.region,
                res.nbytes,
                res.segment,
                self.cfg.reserve_timeout_s,
            )

    @property
    def reserved_bytes(self) -> int:
        return self._reserved_bytes

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
        """Segment `n` left the log: archive it (`buffer.archive`), keep its file for reuse, or
        delete it (always, if tainted and not archived)."""
        path = self.dir / _segment_name(n)
        self.maps.forget(n)
        if self.archive is not None:
            self.archive.mkdir(exist_ok=True)
            os.rename(path, self.archive / _segment_name(n))
            self.tainted.discard(n)
        elif n in self.tainted:
            self.tainted.discard(n)
            path.unlink(missing_ok=True)
        elif len(self.pool) < self.pool_max:
            free = self.dir / f"{n:012d}.free"
            os.rename(path, free)
            self.pool.append(free)
        else:
            path.unlink(missing_ok=True)

    def _retire_ready(self, now: float) -> None:
        """Retire the segments no reader or producer may still use."""
        busy = {r.segment for r in self.reservations.values()}
        waiting = []
        for n in self.retiring:
            if n in busy or self.pins.pinned(n, now):
                waiting.append(n)
            else:
                self._retire(n)
        self.retiring = waiting

    def _open_segment(self, n: int) -> None:
        path = self.dir / _segment_name(n)
        self._take_file(path)
        # no O_TRUNC (keep cached pages); 0600: only the shard's user may read or write it
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        if os.fstat(self.fd).st_size < self.cfg.segment_bytes:
            # sparse, at its full size from the start: readers map it once, not at every write
            os.ftruncate(self.fd, self.cfg.segment_bytes)
        self.active = n
        self.active_bytes = 0
        if self.fsync != "none":
            _fsync_dir(self.dir)

    def _close_active(self) -> None:
        if self.fd < 0:
            return
        self._append(SealRecord(), roll=False)
        if self.fsync != "none":
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
        """Cut the log (`log_cut.py`) and write, in the background, the snapshot segment that
        replaces the segments before the cut: the state they held and their live groups."""
        if self.ephemeral:  # only what lives in the segments moves (ZeroMQ PUTs stay in memory)
            snap.groups = [g for g in snap.groups if all(t.loc is not None for t in g.trajs)]
        replaces = self.active
        self._roll(skip=1)  # writes go on in replaces + 2; the snapshot becomes replaces + 1
        live = live_bytes_by_segment(snap.groups)
        target = (1 + self.cfg.compact_ratio) / 2 * sum(g.nbytes for g in snap.groups)
        cut = choose_cut(self.segments, self.segment_bytes, live, target)
        resumes_at = self.segments[cut] if cut < len(self.segments) else replaces + 1
        snap.groups = [g for g in snap.groups if _lies_before(g, resumes_at)]
        tmp = self.dir / (_segment_name(replaces + 1) + ".tmp")
        self._take_file(tmp)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compaction")
        future = self._executor.submit(self._write_snapshot, replaces + 1, resumes_at, tmp, snap)
        self._compaction = Compaction(future, replaces + 1, resumes_at, snap.groups)

    def _write_snapshot(
        self, n: int, resumes_at: int, tmp: Path, snap: Snapshot
    ) -> tuple[int, list[list[Loc]]]:
        """Write the snapshot segment `n`. Returns its length and where each group's
        trajectories now lie in it (in `snap.groups` order)."""
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o600)
        written = 0
        locs: list[list[Loc]] = []
        try:
            record = SnapshotRecord(next_seq=snap.next_seq, settled=snap.settled, resumes_at=resumes_at)
            written += write_all(fd, encode_record(record, [snap.seen.tobytes()], seed=n)[0])
            batch: list[Group] = []
            batch_bytes = 0
            for group in snap.groups:
                batch.append(group)
                batch_bytes += group.nbytes
                if batch_bytes >= SNAPSHOT_RECORD_BYTES:
                    written += self._write_groups(fd, batch, n, written, locs)
                    batch, batch_bytes = [], 0
            if batch:
                written += self._write_groups(fd, batch, n, written, locs)
            if snap.priorities:
                seqs = list(snap.priorities)
                record = PriorityRecord(seqs=seqs, priorities=[snap.priorities[s] for s in seqs])
                written += write_all(fd, encode_record(record, seed=n)[0])
            for lease in snap.leases:
                written += write_all(fd, encode_record(lease, seed=n)[0])
            written += write_all(fd, encode_record(SealRecord(), seed=n)[0])
            if self.fsync != "none":
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, self.dir / _segment_name(n))
        if self.fsync != "none":
            _fsync_dir(self.dir)
        return written, locs

    @staticmethod
    def _write_groups(fd: int, groups: list[Group], n: int, at: int, locs: list[list[Loc]]) -> int:
        record = PutRecord(groups=[LoggedGroup(seq=g.seq, trajs=g.metas) for g in groups])
        buffers, _ = encode_record(record, [f for g in groups for f in g.frames], seed=n)
        pos = at + PREFIX.size + len(buffers[1])
        for group in groups:
            group_locs = []
            for t in group.trajs:
                group_locs.append((n, pos))
                pos += t.nbytes
            locs.append(group_locs)
        return write_all(fd, buffers)

    def _finish_compaction(self, compaction: Compaction) -> None:
        self._compaction = None
        try:
            written, locs = compaction.future.result()
        except Exception:  # noqa: BLE001 - the old segments are intact; retry later
            log.exception("compaction of %s failed; keeping the uncompacted log", self.dir)
            self.counters["compaction_errors"] += 1
            self._compact_retry_at = time.monotonic() + 30.0
            for tmp in self.dir.glob("*.tmp"):
                tmp.unlink(missing_ok=True)
            return
        for group, group_locs in zip(compaction.groups, locs):  # the copied groups lie there now
            for t, loc in zip(group.trajs, group_locs):
                self._move(t, loc)
        retired = [n for n in self.segments if n < compaction.resumes_at]
        for n in retired:
            self.segments.remove(n)
            self.counters["compaction_retired_bytes"] += self.segment_bytes.pop(n)
            self.retiring.append(n)
        self.pool_max = max(self.pool_max, recycle_keep(self.cfg, len(retired)))
        self.segments = sorted([*self.segments, compaction.snapshot])
        self.segment_bytes[compaction.snapshot] = written
        self.counters["compactions"] += 1
        self.counters["compacted_bytes"] += written
        self._retire_ready(time.monotonic())

    def compaction_done(self) -> bool:
        """Whether no compaction is running or waiting to be cleaned up. Safe from any thread,
        unlike `wait_for_compaction`: a serving shard's own thread finishes a compaction at its
        next tick (at most 0.1 s apart), so another thread waits for this instead."""
        return self._compaction is None

    def wait_for_compaction(self) -> None:
        """Block until a running compaction is done and cleaned up. Only from the thread that
        owns the log (a log used directly, shutdown): it changes the log's state."""
        if self._compaction is not None:
            self._compaction.future.exception()
            self._finish_compaction(self._compaction)

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        self.wait_for_compaction()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self.fd >= 0:
            try:
                self._close_active()
            except LogWriteError as e:
                log.warning("%s: could not seal the last segment: %s", self.dir, e)
                os.close(self.fd)
                self.fd = -1
        self.maps.clear()
        if self.ephemeral:  # mapped files stay readable for whoever still maps them
            shutil.rmtree(self.dir, ignore_errors=True)

    def stats(self) -> dict[str, int]:
        now = time.monotonic()
        return self.counters | {
            "log_bytes": self.total_bytes,
            "log_segments": len(self.segments) + (self.fd >= 0),
            "reservations": len(self.reservations),
            "reserved_bytes": self._reserved_bytes,
            "retiring_segments": len(self.retiring),
            "pinned_segments": self.pins.segments(now),
        }


def _apply(
    record: Record,
    payload: memoryview,
    live: dict[int, Group],
    state: RecoveredState,
    where: Where,
    full: bool = True,
) -> None:
    """Fold one record into the state being recovered (not `full`: its groups and leases only,
    see `_replay_segment`)."""
    if isinstance(record, PutRecord):
        for group in put_groups(record, payload, where):
            live[group.seq] = group
            state.next_seq = max(state.next_seq, group.seq + 1)
            if full:
                hashes = (id_hash(t.meta.traj_id) for t in group.trajs)
                state.seen_hashes.append(np.fromiter(hashes, np.uint64, group.size))
        for seq in record.evicted:
            live.pop(seq, None)
    elif isinstance(record, AckRecord):
        count = sum(live.pop(seq).size for seq in record.seqs if seq in live)
        state.settled[record.lease_id] = count
        state.leases.pop(record.lease_id, None)
    elif isinstance(record, LeaseRecord):
        state.leases[record.lease_id] = record
    elif isinstance(record, UnleaseRecord):
        for lease_id in record.lease_ids:
            state.leases.pop(lease_id, None)
    elif isinstance(record, DropRecord):
        for seq in record.seqs:
            live.pop(seq, None)
    elif isinstance(record, PriorityRecord):
        for seq, p in zip(record.seqs, record.priorities):
            state.priorities[seq] = p
    elif isinstance(record, SnapshotRecord) and full:
        # what the log held before this segment: the groups kept in place were read already
        state.seen_hashes = [np.frombuffer(payload, dtype=np.uint64)]
        state.settled = dict(record.settled)
        state.next_seq = max(state.next_seq, record.next_seq)


def _lies_before(group: Group, segment: int) -> bool:
    """The group's arrays are (at least partly) in a segment before `segment`, or in memory."""
    n = group_segment(group)
    return n is None or n < segment


def held_leases(logged: dict[str, LeaseRecord], live: dict[int, Group]) -> dict[str, LeaseRecord]:
    """The leases still held at the log's end, each with the seqs of its live groups. A group
    leased again later (its earlier lease ended in a record that was not written) belongs to
    its newest lease; a lease with no live group left is over."""
    owner: dict[int, str] = {}
    for lease_id, record in logged.items():  # in log order
        for seq in record.seqs:
            owner[seq] = lease_id
    seqs: dict[str, list[int]] = {}
    for seq, lease_id in owner.items():
        if seq in live:
            seqs.setdefault(lease_id, []).append(seq)
    return {i: msgspec.structs.replace(logged[i], seqs=sorted(v)) for i, v in seqs.items()}


def build_log(cfg: BufferConfig, directory: Path | None, arena: Path | None = None) -> ExperienceLog:
    """SegmentLog in `directory`; else an ephemeral one in `arena` (same-host sharing without
    durability); else NoLog."""
    if directory is not None:
        return SegmentLog(directory, cfg)
    if arena is not None:
        return SegmentLog(arena, cfg, ephemeral=True)
    return NoLog()
