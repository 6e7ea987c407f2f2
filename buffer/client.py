"""The buffer's client library: what rollout services and learners use to reach the shards.

Socket rules:
- One DEALER per shard, connected (never bound) to the shard's ROUTER. Messages are
  `[b"", header, payload...]` so the shard can answer REQ and DEALER clients alike.
- Every request carries an id; a reply with another id (the late answer to a request that
  timed out) is discarded. A request never waits longer than its timeout.
- PUT is idempotent (the shard dedupes by traj_id), so it is retried freely: after a FULL
  reply with retry-after (backpressure: the producer slows down), or after a timeout.
- A GET whose reply is lost leaves a lease that expires on the shard and is redelivered, so
  a timeout loses nothing.
- Groups are placed on shard hash(group_id) % n_shards (xxh64, stable across processes).
- Not thread-safe: one client per thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import xxhash
import zmq

from sluice.rpc import RpcConnection
from sluice.rpc import RpcError as BufferError
from sluice.rpc import RpcTimeout as BufferTimeout
from sluice.trajectory import Trajectory, from_wire_batch, to_wire_batch
from sluice.wire.messages import (
    PROTO_VERSION,
    AckRequest,
    GetReply,
    GetRequest,
    NackRequest,
    PingRequest,
    PutReply,
    PutRequest,
    StatsReply,
    StatsRequest,
)


class PutAborted(RuntimeError):
    """`should_abort` turned true while a PUT was waiting out backpressure or a timeout."""


def shard_of(group_id: str, n_shards: int) -> int:
    return xxhash.xxh64_intdigest(group_id.encode()) % n_shards


@dataclass
class LeasedBatch:
    """Trajectories under lease. ACK after using them, NACK to give them back."""

    trajs: list[Trajectory] = field(default_factory=list)
    leases: list[tuple[int, str]] = field(default_factory=list)  # (shard, lease_id)
    dropped_stale: int = 0

    def extend(self, other: LeasedBatch) -> None:
        self.trajs.extend(other.trajs)
        self.leases.extend(other.leases)
        self.dropped_stale += other.dropped_stale


class BufferClient:
    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout_s: float = 30.0,
        put_give_up_s: float = 600.0,
        should_abort: Callable[[], bool] = lambda: False,
        ctx: zmq.Context | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("BufferClient needs at least one shard endpoint")
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.shards = [RpcConnection(self.ctx, ep, name=f"shard {k}") for k, ep in enumerate(endpoints)]
        self.timeout_s = timeout_s
        self.put_give_up_s = put_give_up_s
        self.should_abort = should_abort
        self._next_read = 0
        self.backpressure_s = 0.0  # total time spent waiting on full shards

    # -- producer side -------------------------------------------------------------------------

    def put(self, trajs: Sequence[Trajectory]) -> PutReply:
        """Store trajectories (whole groups) on their shards; wait out backpressure."""
        by_shard: dict[int, list[Trajectory]] = {}
        for t in trajs:
            by_shard.setdefault(shard_of(t.group_id, len(self.shards)), []).append(t)
        total = PutReply(proto=PROTO_VERSION, id=0)
        for k, part in by_shard.items():
            reply = self._put_one(self.shards[k], part)
            total.accepted += reply.accepted
            total.duplicates += reply.duplicates
        return total

    def _put_one(self, conn: RpcConnection, trajs: Sequence[Trajectory]) -> PutReply:
        metas, frames = to_wire_batch(trajs)
        give_up = time.monotonic() + self.put_give_up_s
        while True:
            header = PutRequest(proto=PROTO_VERSION, id=conn.next_id(), trajs=metas)
            try:
                reply, _ = conn.request(header, frames, self.timeout_s)
                return reply
            except BufferError as e:
                if e.code != "FULL" or time.monotonic() > give_up:
                    raise
                wait = e.retry_after_ms / 1000.0
            except BufferTimeout:
                if time.monotonic() > give_up:
                    raise
                wait = 0.0
            if self.should_abort():
                raise PutAborted(f"PUT to {conn.name} abandoned on request")
            self.backpressure_s += wait
            time.sleep(wait)

    # -- consumer side -------------------------------------------------------------------------

    def get(
        self, max_trajs: int, *, min_version: int = 0, policy_id: str = "default", wait_ms: int = 0
    ) -> LeasedBatch:
        """Lease up to `max_trajs` trajectories (whole groups), visiting shards round-robin.
        The wait is spent on the first shard visited; the others are asked without waiting."""
        batch = LeasedBatch()
        n = len(self.shards)
        start = self._next_read
        self._next_read = (self._next_read + 1) % n
        for i in range(n):
            if len(batch.trajs) >= max_trajs:
                break
            conn = self.shards[(start + i) % n]
            header = GetRequest(
                proto=PROTO_VERSION,
                id=conn.next_id(),
                max_trajs=max_trajs - len(batch.trajs),
                min_version=min_version,
                policy_id=policy_id,
                wait_ms=wait_ms if i == 0 else 0,
            )
            reply, frames = conn.request(header, timeout_s=self.timeout_s + wait_ms / 1000.0)
            assert isinstance(reply, GetReply)
            part = LeasedBatch(dropped_stale=reply.dropped_stale)
            if reply.lease_id:
                part.trajs = from_wire_batch(reply.trajs, frames)
                part.leases = [((start + i) % n, reply.lease_id)]
            batch.extend(part)
        return batch

    def ack(self, batch: LeasedBatch) -> int:
        return self._settle(batch, AckRequest)

    def nack(self, batch: LeasedBatch) -> int:
        return self._settle(batch, NackRequest)

    def _settle(self, batch: LeasedBatch, kind) -> int:
        count = 0
        for shard, lease_id in batch.leases:
            conn = self.shards[shard]
            reply, _ = conn.request(
                kind(proto=PROTO_VERSION, id=conn.next_id(), lease_id=lease_id), timeout_s=self.timeout_s
            )
            count += reply.count
        return count

    # -- operations ----------------------------------------------------------------------------

    def stats(self) -> list[StatsReply]:
        out = []
        for conn in self.shards:
            reply, _ = conn.request(
                StatsRequest(proto=PROTO_VERSION, id=conn.next_id()), timeout_s=self.timeout_s
            )
            out.append(reply)
        return out

    def ping(self, timeout_s: float = 1.0) -> bool:
        try:
            for conn in self.shards:
                conn.request(PingRequest(proto=PROTO_VERSION, id=conn.next_id()), timeout_s=timeout_s)
        except BufferTimeout:
            return False
        return True

    def close(self) -> None:
        for conn in self.shards:
            conn.close()
        if self._own_ctx:
            self.ctx.term()

    def __enter__(self) -> BufferClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
