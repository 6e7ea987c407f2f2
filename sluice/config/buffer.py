"""Buffer shards: where they listen, how they hold experience, and how durably."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from sluice.config.base import Section


class ReplayConfig(Section):
    sampling: Literal["uniform", "prioritized"] = "uniform"
    """uniform: every stored group equally likely. prioritized: proportional to (priority+eps)^alpha."""
    alpha: float = Field(default=0.6, ge=0.0, le=1.0)
    """Priority exponent (PER's alpha): 0 is uniform, 1 is fully proportional to priority."""
    eps: float = Field(default=1e-6, gt=0.0)
    """Added to every priority so that no stored group has probability 0."""
    initial_priority: float | None = Field(default=None, gt=0.0)
    """Priority of a newly stored group. None: the largest priority seen so far (PER's rule)."""


class BufferConfig(Section):
    shards: int = Field(default=1, ge=1)
    """Number of shard servers. A group goes to its home shard, xxh64(group_id) % shards, or
    while that one is down to the next up in an order of its own (buffer/placement.py)."""
    mode: Literal["fifo", "replay"] = "fifo"
    """fifo: consume-once under leases (ACK deletes, lease timeout or NACK redelivers).
    replay: bounded ring (oldest evicted first), sampled with replacement (SAMPLE/PRIORITY)."""
    capacity: int = Field(default=65536, ge=1)
    """fifo: trajectories waiting for a learner (queued), then PUT is refused; leased ones do
    not count (a learner holds what it trained until its next checkpoint). replay: ring size."""
    capacity_bytes: int = Field(default=4 << 30, ge=1 << 20)
    """Payload bytes a shard holds, leased ones included: bounds memory for large trajectories."""
    lease_timeout_s: float = Field(default=60.0, gt=0)
    """A lease not ACKed within this time is returned to the queue."""
    max_message_bytes: int = Field(default=1 << 30, ge=1024)
    """ZMQ_MAXMSGSIZE of a shard: a larger message closes the sender's connection."""
    max_batch: int = Field(default=8192, ge=1)
    """Most trajectories in one PUT, asked for by one GET or SAMPLE, or keys in one PRIORITY."""
    max_policies: int = Field(default=64, ge=1)
    """Distinct policy_ids a shard keeps streams for; a PUT that would add one more is refused."""
    retry_after_ms: int = Field(default=100, ge=1)
    """What a full shard tells producers to wait before the next PUT."""
    dedupe_window: int = Field(default=1 << 18, ge=1024)
    """traj_ids remembered for dedupe (between this and half of it, newest first; ~60 B each).
    Must cover the ids a producer may still resend: PUT rate x the client's give-up time."""
    replay: ReplayConfig = ReplayConfig()
    """Sampling of `mode: replay` shards."""
    durable: bool = True
    """Keep an append-only log per shard; a restarted shard rebuilds its state from it.
    False keeps everything in memory only (a restart loses the shard's contents)."""
    log_dir: str | None = None
    """Directory of shard k's log is <log_dir>/shard-<k>. None: <run dir>/buffer."""
    archive: bool = False
    """Keep every segment compaction retires in `<shard log>/archive/` instead of reusing or
    deleting it, so the log holds every trajectory the shard ever stored and what became of
    it (`sluice export`). Disk grows with all the experience of the run. Durable shards only."""
    max_restarts: int = Field(default=3, ge=0)
    """Times a launcher (local or Ray) restarts a shard that died (killed, crashed), on the same
    endpoint, from its log. Durable shards only: one without a log would come back empty, and
    what it had acknowledged would be lost, so its death fails the run."""
    fsync: Literal["always", "interval", "none"] = "interval"
    """always: fsync before every reply that depends on a write (survives power loss).
    interval: every `fsync_interval_ms`. none: never (survives a crash of the shard, not of the OS).
    Every policy writes the record before it replies: a killed shard loses nothing it acknowledged."""
    fsync_interval_ms: int = Field(default=200, ge=1)
    """Most time between a write and its fsync with `fsync: interval`."""
    segment_bytes: int = Field(default=64 << 20, ge=1 << 16)
    """A log segment is closed and a new one started past this size (retired segments are reused)."""
    compact_min_bytes: int = Field(default=256 << 20, ge=1 << 16)
    """The log is never compacted below this size."""
    compact_ratio: float = Field(default=2.0, ge=1.1)
    """Compact when the log is larger than this times the bytes of the samples it still holds."""
    same_host_transport: Literal["auto", "zmq"] = "auto"
    """auto: clients on the shard's host move payload bytes through shared memory (the shard's
    segment files; ZeroMQ carries only headers) after proving they see the shard's files;
    zmq: every byte travels over ZeroMQ. Remote clients always use ZeroMQ."""
    shm_dir: str = "/dev/shm"
    """Where a shard without a log (durable false, or no log directory) keeps the memory-backed
    segments that same-host clients share; removed when the shard stops."""
    same_host_min_put_bytes: int = Field(default=64 << 10, ge=0)
    """PUT messages with fewer payload bytes than this go over ZeroMQ even on the same host
    (a reservation round trip costs more than copying a few KB)."""
    reserve_timeout_s: float = Field(default=60.0, gt=0)
    """A same-host producer must PUT the space it reserved within this time; later the space
    is abandoned and its segment file is deleted, never reused (a late write cannot land in it)."""
    same_host_view_hold_s: float = Field(default=30.0, gt=0)
    """Replay: arrays returned by a same-host SAMPLE are views of segment files; a segment is
    not reused for this long after a SAMPLE returned views of it. Copy what you keep longer."""
    host: str = "127.0.0.1"
    """Host clients connect to when `endpoints` is empty."""
    base_port: int = Field(default=0, ge=0, le=65535)
    """Shard k listens on base_port + k. 0: the local launcher picks free ports."""
    endpoints: list[str] = []
    """Explicit client endpoints, one per shard (e.g. tcp://buffer-0:5555). Overrides host/port."""
    bind: list[str] = []
    """Explicit bind endpoints, one per shard (e.g. tcp://*:5555). Default: the endpoint."""

    @model_validator(mode="after")
    def _endpoint_counts(self) -> BufferConfig:
        for name in ("endpoints", "bind"):
            given = getattr(self, name)
            if given and len(given) != self.shards:
                raise ValueError(f"buffer.{name} has {len(given)} entries but buffer.shards is {self.shards}")
        return self

    def endpoint(self, shard: int) -> str:
        if self.endpoints:
            return self.endpoints[shard]
        if self.base_port == 0:
            raise ValueError("buffer.base_port is 0 and buffer.endpoints is empty: no address")
        return f"tcp://{self.host}:{self.base_port + shard}"

    def bind_endpoint(self, shard: int) -> str:
        return self.bind[shard] if self.bind else self.endpoint(shard)

    def all_endpoints(self) -> list[str]:
        return [self.endpoint(k) for k in range(self.shards)]

    def shard_log_dir(self, shard: int, run_dir: Path | None) -> Path | None:
        """Where shard `shard` keeps its log; None when durability is off.
        Raises if durability is on but neither `log_dir` nor a run directory says where."""
        if not self.durable:
            return None
        if self.log_dir is not None:
            return Path(self.log_dir) / f"shard-{shard}"
        if run_dir is None:
            raise ValueError(
                "buffer.durable is true but neither buffer.log_dir nor run.dir is set: "
                "set one of them, or buffer.durable=false to run without a log"
            )
        return run_dir / "buffer" / f"shard-{shard}"
