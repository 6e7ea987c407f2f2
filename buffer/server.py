"""One buffer shard: a ZeroMQ ROUTER server in front of a FifoStore.

Socket rules:
- The shard binds a ROUTER at its endpoint; clients (DEALER or REQ) connect. Clients may start
  before the shard: ZeroMQ connects when it comes up.
- A request is `[identity, b"", header, payload...]` as the ROUTER sees it. The empty delimiter
  is what REQ sends; DEALER clients send it too. (A message without it is also accepted.)
  The reply goes back with the same envelope.
- ZMQ_MAXMSGSIZE = buffer.max_message_bytes: ZeroMQ drops the connection of a peer that sends
  a larger message; everything below that is parsed and either served or answered with an
  ErrorReply naming the bad field or frame. The loop never dies on input.
- GET with wait_ms > 0 is parked until data arrives or the wait ends (long poll), so
  learners do not spin. One thread owns the socket and the store: no locks.
- Linger 0 at close: a stopped shard does not block on unsent replies.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from buffer.fifo_store import FifoStore, GroupIncomplete, ShardFull
from buffer.metrics import ShardMetrics
from sluice.config.buffer import BufferConfig
from sluice.net import zmq_socket
from sluice.rpc import split_envelope
from sluice.wire import codec
from sluice.wire.messages import (
    PROTO_VERSION,
    AckReply,
    AckRequest,
    GetReply,
    GetRequest,
    NackReply,
    NackRequest,
    PingReply,
    PingRequest,
    PutReply,
    PutRequest,
    StatsReply,
    StatsRequest,
)

log = logging.getLogger(__name__)

Envelope = list[bytes]


@dataclass
class ParkedGet:
    envelope: Envelope
    request: GetRequest
    deadline: float


class ShardServer:
    def __init__(
        self,
        cfg: BufferConfig,
        shard: int,
        *,
        metrics: ShardMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        ctx: zmq.Context | None = None,
    ) -> None:
        self.cfg = cfg
        self.shard = shard
        self.clock = clock
        self.store = FifoStore(capacity=cfg.capacity, lease_timeout_s=cfg.lease_timeout_s)
        self.metrics = metrics
        self.parked: list[ParkedGet] = []
        self._ctx = ctx or zmq.Context.instance()
        self.sock = zmq_socket(self._ctx, zmq.ROUTER, hwm=10000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.endpoint = cfg.bind_endpoint(shard)
        self.sock.bind(self.endpoint)
        self._last_metrics = 0.0

    # -- loop ----------------------------------------------------------------------------------

    def serve(self, stop: threading.Event) -> None:
        """Serve until `stop` is set. Returns with the socket closed."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        log.info("shard %d serving at %s", self.shard, self.endpoint)
        try:
            while not stop.is_set():
                if poller.poll(self._poll_timeout_ms()):
                    # Drain what is ready before doing timed work.
                    for _ in range(256):
                        try:
                            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_message(frames)
                self._on_tick()
        finally:
            self.sock.close(linger=0)

    def _poll_timeout_ms(self) -> int:
        now = self.clock()
        deadlines = [p.deadline for p in self.parked]
        lease_deadline = self.store.next_deadline()
        if lease_deadline is not None:
            deadlines.append(lease_deadline)
        wait = min(deadlines, default=now + 0.1) - now
        return int(max(0.0, min(wait, 0.1)) * 1000)

    def _on_tick(self) -> None:
        now = self.clock()
        if self.store.expire_leases(now):
            self._serve_parked(now)
        expired = [p for p in self.parked if p.deadline <= now]
        if expired:
            self.parked = [p for p in self.parked if p.deadline > now]
            for p in expired:
                self._reply(p.envelope, GetReply(proto=PROTO_VERSION, id=p.request.id))
        if self.metrics is not None and now - self._last_metrics > 0.5:
            self._last_metrics = now
            self.metrics.update(self.store.stats())

    # -- dispatch ------------------------------------------------------------------------------

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        envelope, body = split_envelope(frames)
        if envelope is None:
            return  # nothing to reply to
        request_id = -1
        try:
            request, payload = codec.decode_request(body)
            request_id = request.id
            self._dispatch(envelope, request, payload)
        except codec.ProtocolError as e:
            rid = getattr(e, "request_id", request_id)
            self._count_error(e.code)
            self._reply(envelope, codec.error_reply(rid, e.code, e.message))
        except Exception as e:  # noqa: BLE001 - a bug must not take the shard down
            log.exception("shard %d: internal error on request %d", self.shard, request_id)
            self._count_error("INTERNAL")
            self._reply(envelope, codec.error_reply(request_id, "INTERNAL", repr(e)))

    def _dispatch(self, envelope: Envelope, request, payload: list[zmq.Frame]) -> None:
        now = self.clock()
        if isinstance(request, PutRequest):
            self._on_put(envelope, request, payload, now)
            return
        if payload:
            raise codec.ProtocolError(
                "BAD_PAYLOAD", f"{type(request).__name__} takes no payload frames, got {len(payload)}"
            )
        if isinstance(request, GetRequest):
            self._on_get(envelope, request, now)
        elif isinstance(request, AckRequest):
            count = self._settle(request.lease_id, self.store.ack)
            self._reply(envelope, AckReply(proto=PROTO_VERSION, id=request.id, count=count))
        elif isinstance(request, NackRequest):
            count = self._settle(request.lease_id, self.store.nack)
            self._reply(envelope, NackReply(proto=PROTO_VERSION, id=request.id, count=count))
            self._serve_parked(now)
        elif isinstance(request, StatsRequest):
            stats = self.store.stats() | {"shard": self.shard, "parked_gets": len(self.parked)}
            reply = StatsReply(
                proto=PROTO_VERSION, id=request.id, stats=stats, versions=self.store.version_counts()
            )
            self._reply(envelope, reply)
        elif isinstance(request, PingRequest):
            self._reply(envelope, PingReply(proto=PROTO_VERSION, id=request.id))

    def _on_put(self, envelope: Envelope, req: PutRequest, payload, now: float) -> None:
        if len(req.trajs) > self.cfg.max_batch:
            raise codec.ProtocolError(
                "TOO_LARGE", f"trajs: {len(req.trajs)} trajectories > max_batch {self.cfg.max_batch}"
            )
        per_traj = codec.split_payload(req.trajs, payload)
        try:
            accepted, dupes = self.store.put(req.trajs, per_traj)
        except GroupIncomplete as e:
            raise codec.ProtocolError("BAD_HEADER", f"trajs: {e}") from None
        except ShardFull as e:
            self._count_error("FULL")
            self._reply(
                envelope,
                codec.error_reply(req.id, "FULL", str(e), retry_after_ms=self.cfg.retry_after_ms),
            )
            return
        self._reply(envelope, PutReply(proto=PROTO_VERSION, id=req.id, accepted=accepted, duplicates=dupes))
        if accepted:
            self._serve_parked(now)

    def _on_get(self, envelope: Envelope, req: GetRequest, now: float) -> None:
        if not 1 <= req.max_trajs <= self.cfg.max_batch:
            raise codec.ProtocolError(
                "TOO_LARGE" if req.max_trajs > 0 else "BAD_HEADER",
                f"max_trajs={req.max_trajs} must be in [1, {self.cfg.max_batch}]",
            )
        if req.wait_ms < 0:
            raise codec.ProtocolError("BAD_HEADER", f"wait_ms={req.wait_ms} must be >= 0")
        if not self._try_get(envelope, req, now, reply_empty=req.wait_ms == 0):
            self.parked.append(ParkedGet(envelope, req, now + req.wait_ms / 1000.0))

    def _try_get(self, envelope: Envelope, req: GetRequest, now: float, reply_empty: bool) -> bool:
        lease, dropped = self.store.get(req.max_trajs, req.policy_id, req.min_version, now)
        if lease is None and not reply_empty:
            return False
        if lease is None:
            self._reply(envelope, GetReply(proto=PROTO_VERSION, id=req.id, dropped_stale=dropped))
            return True
        trajs = [t for g in lease.groups for t in g.trajs]
        reply = GetReply(
            proto=PROTO_VERSION,
            id=req.id,
            lease_id=lease.lease_id,
            trajs=[t.meta for t in trajs],
            dropped_stale=dropped,
        )
        self._reply(envelope, reply, [f for t in trajs for f in t.frames])
        return True

    def _serve_parked(self, now: float) -> None:
        still = []
        for p in self.parked:
            if not self.store.has_ready(p.request.policy_id) or not self._try_get(
                p.envelope, p.request, now, reply_empty=False
            ):
                still.append(p)
        self.parked = still

    def _settle(self, lease_id: str, op: Callable[[str], int]) -> int:
        try:
            return op(lease_id)
        except KeyError:
            raise codec.ProtocolError(
                "UNKNOWN_LEASE", f"lease_id={lease_id!r} is not held (expired, settled or unknown)"
            ) from None

    # -- output --------------------------------------------------------------------------------

    def _reply(self, envelope: Envelope, header, payload=()) -> None:
        self.sock.send_multipart([*envelope, *codec.encode(header, payload)], copy=False)

    def _count_error(self, code: str) -> None:
        if self.metrics is not None:
            self.metrics.errors.labels(code=code).inc()
