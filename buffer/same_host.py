"""The same-host data plane's shared parts: how a client and a shard tell they share a host
(`host_id`: the kernel's boot id; the token file, a fresh random token per shard start, mode
0600), the shard's side (`write_token`, `make_arena` for segments in memory), and a client's
`SameHostPeer` per shard (read-only maps of its segment files for GET/SAMPLE views, write
descriptors for the regions it reserved; `same_host_client.py` drives it). The handshake and
why a token file: docs/architecture.md, Buffer (same-host data plane).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from collections import OrderedDict, deque
from collections.abc import Sequence
from pathlib import Path

import xxhash

from sluice.buffer.log_records import REGION_ALIGN, array_sizes, region_layout, write_all
from sluice.buffer.segment_maps import SegmentGone, SegmentMaps
from sluice.trajectory import Trajectory
from sluice.wire import codec
from sluice.wire.messages import HelloReply, Region, TrajectoryMeta, TrajRef

log = logging.getLogger(__name__)

TOKEN_FILE = "shard.token"
ARENA_PREFIX = "sluice-buffer-"
_ZEROS = bytes(REGION_ALIGN)


def host_id() -> str:
    """This kernel's boot id (unique per machine and boot); the host name where there is none."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return os.uname().nodename


# -- shard side ---------------------------------------------------------------------------------


def write_token(directory: Path) -> str:
    """A new random token in `directory`/shard.token, readable only by this user."""
    token = secrets.token_hex(16)
    tmp = directory / f".{TOKEN_FILE}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    os.replace(tmp, directory / TOKEN_FILE)
    return token


def make_arena(shm_dir: str, shard: int, min_free_bytes: int) -> Path | None:
    """A private directory for a shard's memory-backed segments (durability off), after removing
    those that shards killed before they could clean up left behind. None (with a warning)
    if `shm_dir` is missing, not writable, or too small."""
    base = Path(shm_dir)
    try:
        _remove_orphans(base)
        free = shutil.disk_usage(base).free
        if free < min_free_bytes:
            log.warning(
                "%s has %d MB free, a shard needs %d: same-host transport off (ZeroMQ only)",
                base,
                free >> 20,
                min_free_bytes >> 20,
            )
            return None
        path = base / f"{ARENA_PREFIX}{os.getpid()}-{shard}-{secrets.token_hex(4)}"
        path.mkdir(mode=0o700)
        return path
    except OSError as e:
        log.warning("cannot keep shared segments in %s (%s): same-host transport off", base, e)
        return None


def _remove_orphans(base: Path) -> None:
    for path in base.glob(f"{ARENA_PREFIX}*"):
        pid = path.name[len(ARENA_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- client side --------------------------------------------------------------------------------


class RegionPayload:
    """The arrays of one PUT laid out as a region (region_layout: each trajectory at a multiple
    of 64, its arrays back to back, zeros between): the buffers to write and their checksum."""

    def __init__(self, trajs: Sequence[tuple[TrajectoryMeta, list]]) -> None:
        starts, self.nbytes = region_layout([sum(array_sizes(meta)) for meta, _ in trajs])
        self.buffers: list = []
        end = 0
        for start, (_, frames) in zip(starts, trajs):
            if start > end:
                self.buffers.append(memoryview(_ZEROS)[: start - end])
            self.buffers.extend(frames)
            end = start + sum(codec.frame_bytes(f).nbytes for f in frames)
        self._checksum: int | None = None

    @property
    def checksum(self) -> int:
        """xxh3-64 (seed 0) of the region's bytes (computed once)."""
        if self._checksum is None:
            digest = xxhash.xxh3_64()
            for b in self.buffers:
                digest.update(b)
            self._checksum = digest.intdigest()
        return self._checksum


class SameHostPeer:
    """What a client uses to share memory with one shard (see the module docstring)."""

    def __init__(
        self, shared_dir: Path, token: str, min_put_bytes: int = 0, reserve_timeout_s: float = 60.0
    ) -> None:
        self.dir = shared_dir
        self.token = token
        self.min_put_bytes = min_put_bytes  # the shard's advice: smaller PUTs carry frames
        self.reserve_timeout_s = reserve_timeout_s
        self.maps = SegmentMaps(shared_dir, keep=8)
        self._fds: OrderedDict[int, int] = OrderedDict()
        # Regions the shard reserved for our next PUTs (each asked with an earlier PUT), oldest
        # first, each with the time after which we no longer use it. Several when PUTs are
        # pipelined: each reply brings the region for a PUT one window later.
        self.spares: deque[tuple[Region, float]] = deque()
        self._recent_puts: deque[int] = deque(maxlen=8)

    @classmethod
    def open(cls, reply: HelloReply) -> SameHostPeer | None:
        """The peer a HELLO reply offers, if this process is on the shard's host and can read
        its token file; else None (ZeroMQ)."""
        if not reply.shared_dir or reply.host_id != host_id():
            return None
        shared_dir = Path(reply.shared_dir)
        try:
            token = (shared_dir / reply.token_file).read_text().strip()
        except OSError as e:
            log.info("shard's shared directory %s not readable here (%s): using ZeroMQ", shared_dir, e)
            return None
        if not token:
            return None
        return cls(shared_dir, token, reply.min_put_bytes, reply.reserve_timeout_ms / 1000.0)

    # -- producer ------------------------------------------------------------------------------

    def spare_for(self, nbytes: int, now: float) -> tuple[Region | None, list[int]]:
        """(the oldest spare region, if it can take `nbytes` now, else None; the spare regions
        to release: those too small or too old, passed over). A returned region is ours no more."""
        release = []
        while self.spares:
            spare, until = self.spares.popleft()
            if spare.nbytes >= nbytes and now < until:
                return spare, release
            release.append(spare.region)
        return None, release

    def keep_spare(self, region: Region, now: float) -> None:
        """A region the shard reserved for a later PUT; used only well within its timeout."""
        self.spares.append((region, now + self.reserve_timeout_s / 2))

    def note_put_bytes(self, nbytes: int) -> None:
        """The size of a region PUT is about to fill (sizes next_put_bytes)."""
        self._recent_puts.append(nbytes)

    def next_put_bytes(self) -> int:
        """The region to ask for our next PUT: the largest of our last few, so that a PUT a bit
        larger than the one before (groups spread over shards vary) still fits its spare."""
        return max(self._recent_puts, default=0)

    def take_spares(self) -> list[int]:
        """Every spare region, to release (the client is closing)."""
        regions = [r.region for r, _ in self.spares]
        self.spares.clear()
        return regions

    def write(self, segment: int, offset: int, payload: RegionPayload) -> None:
        """Write a PUT's arrays into its region. Raises OSError."""
        write_all(self._fd(segment), payload.buffers, offset)

    def _fd(self, segment: int) -> int:
        fd = self._fds.get(segment)
        if fd is None:
            fd = os.open(self.maps.path(segment), os.O_WRONLY)  # never O_CREAT: it must be the shard's
            self._fds[segment] = fd
            while len(self._fds) > 4:
                os.close(self._fds.popitem(last=False)[1])
        return fd

    # -- consumer ------------------------------------------------------------------------------

    def trajectories(
        self, metas: Sequence[TrajectoryMeta], refs: Sequence[TrajRef], frames: Sequence[codec.Frame]
    ) -> list[Trajectory]:
        """Trajectories whose arrays are views of the shard's segment files where `refs` point
        (and payload frames where a ref's segment is -1). Raises codec.ProtocolError."""
        if len(refs) != len(metas):
            raise codec.ProtocolError("BAD_PAYLOAD", f"{len(refs)} refs for {len(metas)} trajectories")
        inline = [m for m, r in zip(metas, refs) if r.segment < 0]
        per_inline = iter(codec.split_payload(inline, frames))
        out = []
        for i, (meta, ref) in enumerate(zip(metas, refs)):
            if ref.segment < 0:
                out.append(Trajectory.from_wire(meta, next(per_inline)))
                continue
            nbytes = codec.check_specs(meta.arrays, f"trajs[{i}]")
            try:
                data = self.maps.view(ref.segment, ref.offset, nbytes)
            except SegmentGone as e:
                raise codec.ProtocolError("BAD_PAYLOAD", f"refs[{i}]: {e}") from None
            out.append(Trajectory.from_meta(meta, codec.view_arrays(meta.arrays, data)))
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self.maps.clear()
