"""One buffer shard: a ZeroMQ ROUTER server in front of a store (fifo or replay) and its log
(docs/architecture.md, Buffer; the messages: docs/protocol.md).

Socket rules:
- The shard binds a ROUTER at its endpoint (`buffer/sockets.py`); clients (DEALER or REQ)
  connect. Clients may start before the shard: ZeroMQ connects when it comes up. The shard
  rebuilds its state from its log before it binds, so no client sees a half-restored shard.
- A request is `[identity, b"", header, payload...]` as the ROUTER sees it. The empty delimiter
  is what REQ sends; DEALER clients send it too. (A message without it is also accepted.)
  The reply goes back with the same envelope.
- ZMQ_MAXMSGSIZE = buffer.max_message_bytes: ZeroMQ drops the connection of a peer that sends
  a larger message; everything below that is parsed and either served or answered with an
  ErrorReply naming the bad field or frame. The loop never dies on input.
- GET with wait_ms > 0 is parked until data arrives or the wait ends (long poll), so
  learners do not spin; CANCEL from the same connection ends it early.
- One thread owns the socket, the store and the log: no locks. Requests are served in
  batches (what is ready, up to 256); the log is made durable (per `buffer.fsync`) once per
  batch, and only then are the batch's replies sent (group commit): a reply never promises
  more than the log holds.
- Linger 0 at close: a stopped shard does not block on unsent replies.
- Same host: HELLO, RESERVE, PUTs naming a region (checked against their checksum before
  anything is stored), and GET/SAMPLE with the token answered by `TrajRef`s instead of frames,
  their segments pinned (`view_pins.py`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash
import zmq

from sluice.buffer.groups import Group, GroupIncomplete, PutTooLarge, ShardFull
from sluice.buffer.holder import Holder
from sluice.buffer.log_records import region_layout
from sluice.buffer.metrics import ShardMetrics
from sluice.buffer.same_host import host_id, make_arena, write_token
from sluice.buffer.segment_log import LogWriteError, NoSuchRegion, RecoveredState, Snapshot, build_log
from sluice.buffer.segment_maps import SegmentGone
from sluice.buffer.sockets import recv_frames, send_frames, shard_socket
from sluice.buffer.stores import FifoStore, ReplayStore, Store, build_store
from sluice.buffer.stores.fifo import Lease, Superseded, lease_record
from sluice.config.buffer import BufferConfig
from sluice.rpc import split_envelope
from sluice.wire import codec
from sluice.wire.messages import (
    PROTO_VERSION,
    AckReply,
    AckRequest,
    CancelReply,
    CancelRequest,
    GetReply,
    GetRequest,
    HelloReply,
    HelloRequest,
    NackReply,
    NackRequest,
    PingReply,
    PingRequest,
    PriorityReply,
    PriorityRequest,
    PutReply,
    PutRequest,
    Region,
    ReserveReply,
    ReserveRequest,
    SampledItem,
    SampleReply,
    SampleRequest,
    StatsReply,
    StatsRequest,
    TrajRef,
)

log = logging.getLogger(__name__)

Envelope = list[bytes]
DRAIN_BATCH = 256
# Frames below this size are copied out of ZeroMQ when stored. libzmq receives small messages
# into shared 8 KiB chunks (zero-copy receive), and one stored 1 KiB frame would pin a whole
# chunk (measured: ~10 KiB of RSS per stored 1 KiB trajectory). Larger frames get their own
# buffer from libzmq and are stored without a copy.
COMPACT_BELOW = 64 << 10


@dataclass
class ParkedGet:
    envelope: Envelope
    request: GetRequest
    deadline: float
    acked: int = 0  # what the request's `ack` deleted (told in its reply)
    dropped: int = 0  # stale trajectories dropped by its earlier tries (told in its reply)


class ShardServer:
    def __init__(
        self,
        cfg: BufferConfig,
        shard: int,
        *,
        log_dir: Path | None = None,
        metrics: ShardMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        ctx: zmq.Context | None = None,
        seed: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.shard = shard
        self.clock = clock
        self.store: Store = build_store(cfg)
        arena = None
        if cfg.same_host_transport == "auto" and log_dir is None:
            arena = make_arena(cfg.shm_dir, shard, min_free_bytes=2 * cfg.segment_bytes)
        self.log = build_log(cfg, log_dir, arena)
        self._restore(self.log.recover())
        self.host_id = host_id()
        self.token = write_token(self.log.shared_dir) if self.log.shared_dir is not None else ""
        self.refs_served = 0  # trajectories answered by reference (same-host consumers)
        self.metrics = metrics
        self.rng = np.random.default_rng(seed)
        self.parked: list[ParkedGet] = []
        self._outbox: list[list] = []
        self._ctx = ctx or zmq.Context.instance()
        bind = cfg.bind_endpoint(shard)
        self.sock = shard_socket(self._ctx, bind, max_message_bytes=cfg.max_message_bytes, hwm=10000)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)  # as bound (`host:*`: a free port)
        self._last_metrics = 0.0

    def _restore(self, state: RecoveredState) -> None:
        for hashes in state.seen_hashes:
            self.store.dedupe.add_hashes(hashes.tolist())
        self.store.restore(state.groups, state.priorities, state.next_seq)
        self.store.restore_settled(state.settled)
        held = self.store.restore_leases(state.leases.values(), self.clock())
        for lease_id, groups in held.items():  # a same-host holder may read their files by reference
            segments = {t.loc[0] for g in groups for t in g.trajs if t.loc is not None}
            self.log.pins.pin_lease(lease_id, segments)
        if held:
            log.info("shard %d: %d leases held again (their ACKs will find them)", self.shard, len(held))

    # -- loop ----------------------------------------------------------------------------------

    def serve(self, stop: threading.Event) -> None:
        """Serve until `stop` is set. Returns with the socket and the log closed."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        log.info("shard %d (%s) serving at %s", self.shard, self.cfg.mode, self.endpoint)
        try:
            while not stop.is_set():
                if poller.poll(self._poll_timeout_ms()):
                    for _ in range(DRAIN_BATCH):
                        frames = recv_frames(self.sock)
                        if frames is None:
                            break
                        self._on_message(frames)
                    self._flush()
                self._on_tick()
                self._flush()
        finally:
            self.sock.close(linger=0)
            self.log.close()

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
        expired = self.store.expire(now)
        self._end_leases(expired)
        if expired:
            self._serve_parked(now)
        timed_out = [p for p in self.parked if p.deadline <= now]
        if timed_out:
            self.parked = [p for p in self.parked if p.deadline > now]
            for p in timed_out:
                self._reply(p.envelope, self._empty_get_reply(p))
        self.log.tick(time.monotonic(), self.store.held_bytes, self._snapshot)
        if self.metrics is not None and now - self._last_metrics > 0.5:
            self._last_metrics = now
            self.metrics.update(self.stats())

    def _snapshot(self) -> Snapshot:
        return Snapshot(
            groups=self.store.live_groups(),
            priorities=self.store.priorities(),
            next_seq=self.store.next_seq,
            seen=self.store.dedupe.snapshot(),
            settled=self.store.settled_snapshot(),
            leases=self.store.lease_records(),
        )

    def _flush(self) -> None:
        """Make the log as durable as promised, then send the replies that depend on it."""
        if not self._outbox:
            return
        self.log.commit()
        outbox, self._outbox = self._outbox, []
        for frames in outbox:
            send_frames(self.sock, frames)

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
            self._error(envelope, rid, e.code, e.message)
        except LogWriteError as e:
            log.error("shard %d: %s", self.shard, e)
            self._error(envelope, request_id, "UNAVAILABLE", f"the shard cannot write its log: {e}")
        except Exception as e:  # noqa: BLE001 - a bug must not take the shard down
            log.exception("shard %d: internal error on request %d", self.shard, request_id)
            self._error(envelope, request_id, "INTERNAL", repr(e))

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
            self._on_ack(envelope, request)
        elif isinstance(request, NackRequest):
            store = self._fifo("NACK")
            count = self._settle(request.lease_id, store.nack)
            self._end_leases([request.lease_id])
            self._reply(envelope, NackReply(proto=PROTO_VERSION, id=request.id, count=count))
            self._serve_parked(now)
        elif isinstance(request, SampleRequest):
            self._on_sample(envelope, request)
        elif isinstance(request, PriorityRequest):
            self._on_priority(envelope, request)
        elif isinstance(request, CancelRequest):
            self._on_cancel(envelope, request)
        elif isinstance(request, StatsRequest):
            reply = StatsReply(
                proto=PROTO_VERSION, id=request.id, stats=self.stats(), versions=self.store.version_counts()
            )
            self._reply(envelope, reply)
        elif isinstance(request, PingRequest):
            self._reply(envelope, PingReply(proto=PROTO_VERSION, id=request.id))
        elif isinstance(request, HelloRequest):
            self._on_hello(envelope, request)
        elif isinstance(request, ReserveRequest):
            self._on_reserve(envelope, request)

    def stats(self) -> dict[str, int]:
        return (
            self.store.stats()
            | self.log.stats()
            | {
                "shard": self.shard,
                "parked_gets": len(self.parked),
                "same_host": int(bool(self.token)),
                "refs_served": self.refs_served,
            }
        )

    # -- same host -----------------------------------------------------------------------------

    def _on_hello(self, envelope: Envelope, req: HelloRequest) -> None:
        shared = self.log.shared_dir
        reply = HelloReply(
            proto=PROTO_VERSION,
            id=req.id,
            host_id=self.host_id,
            shared_dir=str(shared) if shared is not None else "",
            token_file="shard.token" if shared is not None else "",
            min_put_bytes=self.cfg.same_host_min_put_bytes,
            reserve_timeout_ms=int(self.cfg.reserve_timeout_s * 1000),
        )
        self._reply(envelope, reply)

    def _on_reserve(self, envelope: Envelope, req: ReserveRequest) -> None:
        if not self.token or req.token != self.token:
            raise codec.ProtocolError(
                "NOT_SAME_HOST",
                "token does not match this shard's (it restarted, or offers no shared memory): "
                "send HELLO again or PUT the payload as frames",
            )
        if req.release:
            try:  # never written by its owner: no need to taint its segment
                self.log.claim(req.release, envelope[0])
            except NoSuchRegion:
                pass
            if req.nbytes == 0:  # only that
                self._reply(envelope, ReserveReply(proto=PROTO_VERSION, id=req.id))
                return
        if not 0 < req.nbytes <= min(self.cfg.max_message_bytes, self.cfg.capacity_bytes):
            raise codec.ProtocolError(
                "TOO_LARGE" if req.nbytes > 0 else "BAD_HEADER",
                f"nbytes={req.nbytes} must be in [1, min(max_message_bytes, capacity_bytes)]",
            )
        full = self._reserve_refusal(req.nbytes)
        if full:
            self._error(envelope, req.id, "FULL", full, retry_after_ms=self.cfg.retry_after_ms)
            return
        res = self.log.reserve(req.nbytes, envelope[0], time.monotonic())
        self._reply(
            envelope,
            ReserveReply(
                proto=PROTO_VERSION, id=req.id, region=res.region, segment=res.segment, offset=res.offset
            ),
        )

    def _reserve_refusal(self, nbytes: int) -> str:
        """Why a reservation of `nbytes` must wait (it would pass capacity_bytes with what is
        reserved and what the store cannot evict), or "" if it may go ahead."""
        held = self.store.unevictable_bytes
        if held + self.log.reserved_bytes + nbytes <= self.cfg.capacity_bytes:
            return ""
        return (
            f"{held} bytes held + {self.log.reserved_bytes} reserved + {nbytes} "
            f"> capacity_bytes {self.cfg.capacity_bytes}"
        )

    def _reserve_next(self, envelope: Envelope, req: PutRequest) -> Region | None:
        """The space a same-host PUT asked for its producer's next PUT, if it may have it now
        (otherwise its next PUT simply sends RESERVE). Never where it would roll the log: the
        producer may have PUTs in flight whose regions lie in the active segment (pipelined),
        and rolling before they arrive would make the shard copy them; its RESERVE comes after
        them on the same connection."""
        nbytes = req.reserve_next
        if nbytes <= 0 or nbytes > min(self.cfg.max_message_bytes, self.cfg.capacity_bytes):
            return None
        if not self.log.fits_region(nbytes):
            return None
        if self._reserve_refusal(nbytes):
            return None
        try:
            res = self.log.reserve(nbytes, envelope[0], time.monotonic())
        except LogWriteError:
            return None
        return Region(region=res.region, segment=res.segment, offset=res.offset, nbytes=res.nbytes)

    def _region_payload(self, envelope: Envelope, req: PutRequest, payload) -> tuple:
        """The reserved region a same-host PUT names, checked: (reservation, per-trajectory
        frames as views of it, the trajectories' places, the bytes of it used)."""
        if payload:
            raise codec.ProtocolError(
                "BAD_PAYLOAD", f"a PUT naming a region takes no payload frames, got {len(payload)}"
            )
        if req.region is None:
            raise codec.ProtocolError("BAD_HEADER", "a same-host PUT must name its region")
        try:
            res = self.log.claim(req.region, envelope[0])
        except NoSuchRegion:
            raise codec.ProtocolError(
                "BAD_PAYLOAD", f"region={req.region} is not reserved by this connection (expired or used)"
            ) from None
        sizes = []
        for i, traj in enumerate(req.trajs):
            sizes.append(codec.spec_sizes(traj.arrays, f"trajs[{i}]"))
        starts, total = region_layout([sum(s) for s in sizes])
        if total > res.nbytes:
            raise codec.ProtocolError(
                "BAD_PAYLOAD",
                f"the trajectories need a region of {total} bytes, region {req.region} has {res.nbytes}",
            )
        try:
            data = self.log.region_bytes(res)[:total]
        except SegmentGone as e:
            raise codec.ProtocolError("BAD_PAYLOAD", f"region {req.region} was not written: {e}") from None
        if xxhash.xxh3_64_intdigest(data) != req.region_checksum:
            raise codec.ProtocolError(
                "BAD_PAYLOAD",
                f"region {req.region} does not match region_checksum (not, or not fully, written)",
            )
        per_traj = []
        for start, traj_sizes in zip(starts, sizes):
            frames, at = [], start
            for n in traj_sizes:
                frames.append(data[at : at + n])
                at += n
            per_traj.append(frames)
        return res, per_traj, [(res.segment, res.offset + start) for start in starts], total

    # -- writes --------------------------------------------------------------------------------

    def _on_put(self, envelope: Envelope, req: PutRequest, payload, now: float) -> None:
        res = locs = None
        if req.region is not None:  # (claimed first: whatever happens next, it is used up)
            res, per_traj, locs, used = self._region_payload(envelope, req, payload)
        if len(req.trajs) > self.cfg.max_batch:
            raise codec.ProtocolError(
                "TOO_LARGE", f"trajs: {len(req.trajs)} trajectories > max_batch {self.cfg.max_batch}"
            )
        if res is None:
            payload = [f.bytes if isinstance(f, zmq.Frame) and len(f) < COMPACT_BELOW else f for f in payload]
            per_traj = codec.split_payload(req.trajs, payload)
        try:
            prepared = self.store.prepare_put(req.trajs, per_traj, locs)
        except GroupIncomplete as e:
            raise codec.ProtocolError("BAD_HEADER", f"trajs: {e}") from None
        except PutTooLarge as e:
            raise codec.ProtocolError("TOO_LARGE", str(e)) from None
        except ShardFull as e:
            self._error(envelope, req.id, "FULL", str(e), retry_after_ms=self.cfg.retry_after_ms)
            return
        if prepared.groups and res is not None:
            self.log.append_put_region(prepared, res, used, req.region_checksum)  # LogWriteError: UNAVAILABLE
        elif prepared.groups:
            self.log.append_put(prepared)  # LogWriteError: nothing stored, UNAVAILABLE
        self.store.commit_put(prepared)
        reply = PutReply(
            proto=PROTO_VERSION, id=req.id, accepted=prepared.accepted, duplicates=prepared.duplicates
        )
        if res is not None:
            reply.next_region = self._reserve_next(envelope, req)
        self._reply(envelope, reply)
        if prepared.groups:
            self._serve_parked(now)

    def _on_ack(self, envelope: Envelope, req: AckRequest) -> None:
        count, replayed = self._ack(req.lease_id)
        self._reply(envelope, AckReply(proto=PROTO_VERSION, id=req.id, count=count, replayed=replayed))

    def _ack(self, lease_id: str) -> tuple[int, bool]:
        """Delete a lease's groups (logged first). (trajectories, whether it had been ACKed
        before: a resend whose first reply was lost). Raises UNKNOWN_LEASE."""
        store = self._fifo("ACK")
        if lease_id in store.settled:
            return store.settled[lease_id], True
        lease = self._settle(lease_id, store.lease)
        self.log.append_ack(lease.lease_id, [g.seq for g in lease.groups])
        count = store.ack(lease.lease_id)
        self.log.pins.release_lease(lease.lease_id)
        return count, False

    def _on_priority(self, envelope: Envelope, req: PriorityRequest) -> None:
        store = self._replay("PRIORITY")
        if len(req.keys) > self.cfg.max_batch:
            raise codec.ProtocolError("TOO_LARGE", f"keys: {len(req.keys)} > max_batch {self.cfg.max_batch}")
        try:
            updated, unknown = store.update_priorities(req.keys, req.priorities)
        except ValueError as e:
            raise codec.ProtocolError("BAD_HEADER", str(e)) from None
        self.log.append_priorities(req.keys, req.priorities)
        self._reply(envelope, PriorityReply(proto=PROTO_VERSION, id=req.id, updated=updated, unknown=unknown))

    # -- reads ---------------------------------------------------------------------------------

    def _on_get(self, envelope: Envelope, req: GetRequest, now: float) -> None:
        self._fifo("GET")
        if not 1 <= req.max_trajs <= self.cfg.max_batch:
            raise codec.ProtocolError(
                "TOO_LARGE" if req.max_trajs > 0 else "BAD_HEADER",
                f"max_trajs={req.max_trajs} must be in [1, {self.cfg.max_batch}]",
            )
        if req.wait_ms < 0:
            raise codec.ProtocolError("BAD_HEADER", f"wait_ms={req.wait_ms} must be >= 0")
        if len(req.ack) > self.cfg.max_batch:
            raise codec.ProtocolError(
                "TOO_LARGE", f"ack: {len(req.ack)} leases > max_batch {self.cfg.max_batch}"
            )
        self._take_over(Holder(req.holder, req.incarnation))
        acked = sum(self._ack(lease_id)[0] for lease_id in req.ack)
        get = ParkedGet(envelope, req, now + req.wait_ms / 1000.0, acked)
        if not self._try_get(get, now, reply_empty=req.wait_ms == 0):
            self.parked.append(get)

    def _take_over(self, holder: Holder) -> None:
        """A holder's new incarnation: its earlier ones' leases are requeued at once and their
        parked GETs answered empty (docs/protocol.md, GET)."""
        try:
            orphans = self._fifo("GET").take_over(holder)
        except Superseded as e:
            raise codec.ProtocolError("SUPERSEDED", str(e)) from None
        if orphans is None:
            return
        self._end_leases([lease.lease_id for lease in orphans])
        earlier = [p for p in self.parked if p.request.holder == holder.name]
        self.parked = [p for p in self.parked if p not in earlier]
        for p in earlier:
            self._reply(p.envelope, self._empty_get_reply(p))
        log.info(
            "shard %d: %s started anew: %d trajectories of its earlier leases requeued, %d parked GETs ended",
            self.shard,
            holder.name,
            sum(lease.size for lease in orphans),
            len(earlier),
        )

    def _try_get(self, get: ParkedGet, now: float, reply_empty: bool) -> bool:
        """Lease for the GET and reply; or, if nothing is ready and not `reply_empty`, False (the
        caller parks it). Its reply tells what its `ack` deleted and every stale trajectory any
        of its tries dropped (a try that parks drops too)."""
        store, envelope, req = self._fifo("GET"), get.envelope, get.request
        holder = Holder(req.holder, req.incarnation)
        lease, dropped = store.get(req.max_trajs, req.policy_id, req.min_version, now, holder)
        get.dropped += dropped
        self._log_drops()
        if lease is None and not reply_empty:
            return False
        if lease is None:
            self._reply(envelope, self._empty_get_reply(get))
            return True
        by_ref = bool(req.token) and req.token == self.token
        refs, frames, segments = self._payload(lease.groups, by_ref)
        self.log.pins.pin_lease(lease.lease_id, segments)
        self._log_lease(lease)
        reply = GetReply(
            proto=PROTO_VERSION,
            id=req.id,
            lease_id=lease.lease_id,
            trajs=[m for g in lease.groups for m in g.metas],
            dropped_stale=get.dropped,
            refs=refs,
            acked=get.acked,
        )
        self._reply(envelope, reply, frames)
        return True

    def _payload(self, groups: list[Group], by_ref: bool) -> tuple[list[TrajRef], list, set[int]]:
        """What a reply carries for `groups`: refs (by_ref) where the log holds a trajectory,
        frames for the rest, and the segments whose files the receiver (or ZeroMQ, still
        sending views of them) may read until the lease ends."""
        refs: list[TrajRef] = []
        frames: list = []
        segments: set[int] = set()
        for group in groups:
            for t in group.trajs:
                if by_ref and t.loc is not None:
                    refs.append(TrajRef(t.loc[0], t.loc[1]))
                    segments.add(t.loc[0])
                    continue
                if by_ref:
                    refs.append(TrajRef(-1, 0))
                if t.mapped:
                    segments.add(t.logged_at()[0])
                frames.extend(t.frames)
        if by_ref:
            self.refs_served += sum(r.segment >= 0 for r in refs)
        return refs, frames, segments

    @staticmethod
    def _empty_get_reply(get: ParkedGet) -> GetReply:
        """A GET answered with nothing leased (nothing ready, its wait over, or cancelled)."""
        return GetReply(proto=PROTO_VERSION, id=get.request.id, dropped_stale=get.dropped, acked=get.acked)

    def _serve_parked(self, now: float) -> None:
        if not self.parked:
            return
        store = self._fifo("GET")
        still = []
        for p in self.parked:
            if not store.has_ready(p.request.policy_id) or not self._try_get(p, now, reply_empty=False):
                still.append(p)
        self.parked = still

    def _on_cancel(self, envelope: Envelope, req: CancelRequest) -> None:
        found = [p for p in self.parked if p.envelope == envelope and p.request.id == req.target]
        if found:
            self.parked = [p for p in self.parked if p not in found]
            self._reply(envelope, self._empty_get_reply(found[0]))
        self._reply(envelope, CancelReply(proto=PROTO_VERSION, id=req.id, cancelled=bool(found)))

    def _on_sample(self, envelope: Envelope, req: SampleRequest) -> None:
        store = self._replay("SAMPLE")
        if not 0 <= req.n <= self.cfg.max_batch:
            raise codec.ProtocolError(
                "TOO_LARGE" if req.n > 0 else "BAD_HEADER", f"n={req.n} must be in [0, {self.cfg.max_batch}]"
            )
        if not (math.isfinite(req.beta) and req.beta >= 0):
            raise codec.ProtocolError("BAD_HEADER", f"beta={req.beta} must be finite and >= 0")
        rng = self.rng if req.seed is None else np.random.default_rng(req.seed)
        sample = store.sample(req.n, req.policy_id, req.min_version, req.beta, rng)
        self._log_drops()
        by_ref = bool(req.token) and req.token == self.token
        refs, frames, segments = self._payload([d.group for d in sample.draws], by_ref)
        self.log.pins.hold(segments, time.monotonic() + self.cfg.same_host_view_hold_s)
        reply = SampleReply(
            proto=PROTO_VERSION,
            id=req.id,
            items=[
                SampledItem(key=d.group.seq, size=d.group.size, prob=d.prob, weight=d.weight)
                for d in sample.draws
            ],
            trajs=[m for d in sample.draws for m in d.group.metas],
            count=sample.count,
            total_priority=sample.total_priority,
            dropped_stale=sample.dropped_stale,
            refs=refs,
        )
        self._reply(envelope, reply, frames)

    # -- helpers -------------------------------------------------------------------------------

    def _fifo(self, op: str) -> FifoStore:
        store = self.store
        if store.mode != "fifo":
            raise self._wrong_mode(op, "fifo")
        return store

    def _replay(self, op: str) -> ReplayStore:
        store = self.store
        if store.mode != "replay":
            raise self._wrong_mode(op, "replay")
        return store

    def _wrong_mode(self, op: str, needed: str) -> codec.ProtocolError:
        return codec.ProtocolError(
            "WRONG_MODE", f"op {op} needs buffer.mode={needed}; shard {self.shard} is {self.store.mode}"
        )

    def _log_lease(self, lease: Lease) -> None:
        """Leases are logged so a restarted shard holds them again, but a lease the log could
        not take costs only that: after a restart its groups are queued again (as before
        leases were logged; its holder skips what it trained). Never fail the GET for it."""
        try:
            self.log.append_lease(lease_record(lease))
        except LogWriteError as e:
            log.warning("shard %d: could not log lease %s: %s", self.shard, lease.lease_id, e)

    def _end_leases(self, lease_ids: list[str]) -> None:
        """Leases that ended without an ACK (NACK, expiry, takeover): unpin their files and log
        it (best effort: an unlogged end only holds the groups one lease timeout after a restart)."""
        for lease_id in lease_ids:
            self.log.pins.release_lease(lease_id)
        try:
            self.log.append_unlease(lease_ids)
        except LogWriteError as e:
            log.warning("shard %d: could not log the end of %d leases: %s", self.shard, len(lease_ids), e)

    def _log_drops(self) -> None:
        """Stale drops answer nobody: if the log cannot take them, they are dropped again after a
        restart. Never fail the request for it."""
        seqs = self.store.take_dropped()
        try:
            self.log.append_drop(seqs)
        except LogWriteError as e:
            log.warning("shard %d: could not log %d dropped groups: %s", self.shard, len(seqs), e)

    def _settle(self, lease_id: str, op: Callable):
        try:
            return op(lease_id)
        except KeyError:
            raise codec.ProtocolError(
                "UNKNOWN_LEASE", f"lease_id={lease_id!r} is not held (expired, settled or unknown)"
            ) from None

    # -- output --------------------------------------------------------------------------------

    def _reply(self, envelope: Envelope, header, payload=()) -> None:
        self._outbox.append([*envelope, *codec.encode(header, payload)])

    def _error(self, envelope: Envelope, request_id: int, code: str, message: str, retry_after_ms: int = 0):
        if self.metrics is not None:
            self.metrics.errors.labels(code=code).inc()
        self._reply(envelope, codec.error_reply(request_id, code, message, retry_after_ms=retry_after_ms))
