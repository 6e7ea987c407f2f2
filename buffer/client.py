"""The buffer's client library: what rollout services and learners use to reach the shards.

Placement (producers):
- A group goes to its home shard, xxh64(group_id) % n_shards (stable across processes), so a
  GRPO group is never split and a resend lands where the first copy went (shards dedupe by
  traj_id, each on its own).
- A *new* group whose home shard is down (not connected, or in backoff after a failure) goes to
  the first live shard in a per-group pseudo-random order (rendezvous hashing, so one shard's
  load spreads over all the others). Safe, because the request provably never reached the home
  shard (see `buffer/link.py`: NotSent).
- Once a PUT carrying a group may have reached a shard (sent, then a timeout or disconnect),
  the group is pinned to that shard: every retry goes there, until it answers or the client
  gives up. Rerouting it could store it twice. Pins are remembered for the last
  `PLACEMENT_MEMORY` groups, so a caller's own retry of a failed `put` is pinned too.

Retries and backpressure:
- PUT is idempotent, so it is retried freely: after FULL (waiting the shard's retry-after:
  backpressure, the producer slows down), after a lost connection or a timeout (exponential
  backoff), until `put_give_up_s`; then the last error is raised. `should_abort` is checked
  between attempts (PutAborted). Nothing waits forever.
- ACK/NACK are retried on the lease's shard until `timeout_s`. A shard that ACKed but whose
  reply was lost answers the resend as done (`replayed`).

Reading (consumers):
- GET visits the live shards round-robin (the first shard changes every call) without
  waiting; only if that finds nothing does it long-poll every live shard at once, take the
  first answer, and CANCEL the others (a lease that arrives anyway is kept if it fits, NACKed
  if not). A down shard is skipped, never waited for.
- SAMPLE (replay mode) draws across shards in proportion to their total priority (asked
  first with n=0), so the draw is the same as from one big buffer; importance weights are
  recomputed over all shards.
Same host (`same_host="auto"`, the default; docs/architecture.md):
- A shard on this host whose token file this process can read (see `buffer/link.py`) gets
  PUT messages of at least `same_host_min_put_bytes` through shared memory: RESERVE space in
  its active segment, write the arrays there (pwritev: the one copy, which is also the log
  write), PUT the headers naming the region with its checksum. A refused or failed
  reservation falls back to an ordinary PUT with frames.
- GET and SAMPLE send the shard's token; the reply says where each trajectory's arrays lie
  and the client maps the shard's segment files read-only: the arrays are views of the
  shard's page cache, no copy. They stay valid while the lease is held (until ACK, NACK or
  lease expiry; replay: `buffer.same_host_view_hold_s` after the SAMPLE): copy what you keep
  longer. After that the shard may reuse the file.
- Remote shards, `same_host="zmq"`, and shards that do not offer it use ZeroMQ frames; the
  semantics (leases, dedupe, backpressure, staleness, sampling) are the same either way.

- Not thread-safe: one client per thread.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash
import zmq

from sluice.buffer.link import Backoff, Call, Lost, NotSent, ShardLink, wait_all
from sluice.buffer.same_host import RegionPayload
from sluice.config.buffer import BufferConfig
from sluice.rpc import RpcError as BufferError
from sluice.rpc import RpcTimeout as BufferTimeout
from sluice.trajectory import Trajectory, from_wire_batch
from sluice.wire.codec import Frame
from sluice.wire.messages import (
    PROTO_VERSION,
    AckRequest,
    CancelRequest,
    GetReply,
    GetRequest,
    NackRequest,
    PingRequest,
    PriorityRequest,
    PutReply,
    PutRequest,
    ReserveReply,
    ReserveRequest,
    SampleReply,
    SampleRequest,
    StatsReply,
    StatsRequest,
    TrajectoryMeta,
)

__all__ = [
    "BufferClient",
    "BufferError",
    "BufferTimeout",
    "LeasedBatch",
    "PriorityResult",
    "PutAborted",
    "PutBatcher",
    "PutPipeline",
    "ReplayBatch",
    "SampleRef",
    "ShardUnavailable",
    "shard_of",
]

PLACEMENT_MEMORY = 65536

log = logging.getLogger(__name__)


class PutAborted(RuntimeError):
    """`should_abort` turned true while a PUT was waiting out backpressure or a down shard."""


class ShardUnavailable(BufferTimeout):
    """A shard could not be reached (or did not answer) before the client gave up."""


def shard_of(group_id: str, n_shards: int) -> int:
    return xxhash.xxh64_intdigest(group_id.encode()) % n_shards


def fallback_order(group_id: str, n_shards: int) -> list[int]:
    """Every shard, in a pseudo-random order that depends on the group (rendezvous hashing)."""
    return sorted(range(n_shards), key=lambda k: -xxhash.xxh64_intdigest(f"{group_id}/{k}".encode()))


@dataclass
class LeasedBatch:
    """Trajectories under lease. ACK after using them, NACK to give them back."""

    trajs: list[Trajectory] = field(default_factory=list)
    leases: list[tuple[int, str]] = field(default_factory=list)  # (shard, lease_id)
    dropped_stale: int = 0
    acked: int = 0  # trajectories the `get(ack=...)` that returned this batch ACKed

    def extend(self, other: LeasedBatch) -> None:
        self.trajs.extend(other.trajs)
        self.leases.extend(other.leases)
        self.dropped_stale += other.dropped_stale


@dataclass(frozen=True)
class SampleRef:
    """Where a sampled group lives: what `update_priorities` needs."""

    shard: int
    key: int


@dataclass
class ReplayBatch:
    """Trajectories drawn from replay shards, with replacement. Per trajectory (aligned with
    `trajs`): `refs` (its group), `probs` (probability of drawing its group, over all shards)
    and `weights` (importance weight (N * prob) ** -beta / max, N = groups eligible over all
    shards). The trajectories of one group are adjacent and share ref, prob and weight."""

    trajs: list[Trajectory] = field(default_factory=list)
    refs: list[SampleRef] = field(default_factory=list)
    probs: np.ndarray = field(default_factory=lambda: np.zeros(0))
    weights: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    count: int = 0  # groups eligible over the shards asked
    dropped_stale: int = 0


@dataclass
class PriorityResult:
    updated: int = 0  # groups whose priority was set
    unknown: int = 0  # groups no longer stored (evicted or dropped)
    unreached: int = 0  # groups on shards that did not answer (priorities are advisory: not retried)


@dataclass
class _OutGroup:
    """A group on its way to a shard."""

    group_id: str
    wire: list[tuple[TrajectoryMeta, list[Frame]]]  # each trajectory's header and array frames
    nbytes: int
    shard: int | None = None
    pinned: bool = False  # a PUT carrying it may have reached `shard`: never route it elsewhere
    frames_only: bool = False  # its same-host PUT was refused: send its arrays as frames

    @property
    def metas(self) -> list[TrajectoryMeta]:
        return [m for m, _ in self.wire]

    @property
    def frames(self) -> list[Frame]:
        return [f for _, frames in self.wire for f in frames]


class BufferClient:
    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout_s: float = 30.0,
        put_give_up_s: float = 600.0,
        should_abort: Callable[[], bool] = lambda: False,
        ctx: zmq.Context | None = None,
        max_batch: int = 8192,
        max_message_bytes: int = 1 << 30,
        put_message_bytes: int = 64 << 20,
        first_connect_s: float = 2.0,
        backoff: Backoff | None = None,
        seed: int | None = None,
        same_host: str = "auto",
        same_host_min_put_bytes: int | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("BufferClient needs at least one shard endpoint")
        if same_host not in ("auto", "zmq"):
            raise ValueError(f"same_host={same_host!r} must be 'auto' or 'zmq'")
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        backoff = backoff or Backoff()
        self.links = [
            ShardLink(self.ctx, k, ep, backoff=backoff, first_connect_s=first_connect_s, same_host=same_host)
            for k, ep in enumerate(endpoints)
        ]
        self.same_host_min_put_bytes = same_host_min_put_bytes  # None: each shard's advice
        self._closed = False
        self.timeout_s = timeout_s
        self.put_give_up_s = put_give_up_s
        self.should_abort = should_abort
        self.max_batch = max_batch
        self.max_message_bytes = max_message_bytes
        self.put_message_bytes = min(put_message_bytes, max_message_bytes // 2)
        self.rng = np.random.default_rng(seed)
        self._placement: OrderedDict[str, int] = OrderedDict()
        self._next_read = 0
        self.backpressure_s = 0.0  # total time spent waiting on full shards
        self.rerouted_groups = 0  # new groups stored away from their home shard (it was down)
        self.shared_put_bytes = 0  # payload bytes PUT through shared memory (same host)
        self.reserve_requests = 0  # RESERVE round trips (most same-host PUTs need none)
        self.shared_get_trajs = 0  # trajectories received as views of a shard's files (same host)

    @classmethod
    def from_config(cls, cfg: BufferConfig, **kwargs) -> BufferClient:
        """A client for the shards of `cfg`, with its limits."""
        kwargs.setdefault("max_batch", cfg.max_batch)
        kwargs.setdefault("max_message_bytes", cfg.max_message_bytes)
        kwargs.setdefault("same_host", cfg.same_host_transport)
        return cls(cfg.all_endpoints(), **kwargs)

    @property
    def n_shards(self) -> int:
        return len(self.links)

    # -- producer side -------------------------------------------------------------------------

    def put(self, trajs: Sequence[Trajectory]) -> PutReply:
        """Store trajectories (whole groups) on their shards; wait out backpressure and down
        shards (see the module docstring). Returns the summed accepted/duplicates counts.
        If it raises, groups on other shards may have been stored: calling `put` again with the
        same trajectories is safe (they are deduped, and pinned to where they may have gone)."""
        total = PutReply(proto=PROTO_VERSION, id=0)
        self._put_groups(self._out_groups(trajs), total)
        return total

    def _put_groups(self, todo: list[_OutGroup], total: PutReply) -> None:
        """Send `todo` and retry what fails until every group is stored (or give up: raise)."""
        give_up = time.monotonic() + self.put_give_up_s
        while todo:
            sent = self._send_puts(self._plan_messages(todo))
            wait_all([call for _, call in sent], self.links)
            todo, wait_s, last_error = self._harvest(sent, total)
            if todo:
                self._wait_before_retry(wait_s, give_up, last_error, full=_is_full(last_error))

    def _harvest(
        self, sent: Sequence[tuple[list[_OutGroup], Call]], total: PutReply
    ) -> tuple[list[_OutGroup], float, BaseException | None]:
        """Account for finished PUTs: add what they stored to `total`, keep the regions their
        shards reserved for our next PUTs. Returns the groups to send again, how long to wait
        first, and the last error; raises errors no retry can fix."""
        todo: list[_OutGroup] = []
        wait_s, last_error = 0.0, None
        for groups, call in sent:
            if call.error is None:
                total.accepted += call.reply.accepted
                total.duplicates += call.reply.duplicates
                for g in groups:
                    self._pin(g)
                if call.reply.next_region is not None and call.peer is call.link.peer:
                    call.peer.keep_spare(call.reply.next_region, time.monotonic())
                continue
            last_error = call.error
            todo.extend(groups)
            if _refused_region(call):  # (a bug, somewhere): the same PUT with frames
                log.warning("%s: %s; sending it as frames", call.link.name, call.error)
                for g in groups:
                    g.frames_only = True
            elif isinstance(call.error, BufferError) and call.error.code == "FULL":
                wait_s = max(wait_s, call.error.retry_after_ms / 1000.0)
            elif isinstance(call.error, Lost):
                for g in groups:
                    self._pin(g)
                wait_s = max(wait_s, self._retry_delay(groups))
            elif isinstance(call.error, NotSent) or (
                isinstance(call.error, BufferError) and call.error.code == "UNAVAILABLE"
            ):
                wait_s = max(wait_s, self._retry_delay(groups))
            else:
                raise call.error  # a request the shard will never take (BAD_HEADER, TOO_LARGE...)
        return todo, wait_s, last_error

    def pipeline(self, window: int = 2) -> PutPipeline:
        """PUTs that do not wait for their replies, up to `window` in flight (see PutPipeline)."""
        return PutPipeline(self, window)

    def batcher(self, max_trajs: int = 256, max_bytes: int = 4 << 20, linger_s: float = 0.05) -> PutBatcher:
        """Collects small PUTs into larger ones (see PutBatcher)."""
        return PutBatcher(self, max_trajs=max_trajs, max_bytes=max_bytes, linger_s=linger_s)

    def _out_groups(self, trajs: Sequence[Trajectory]) -> list[_OutGroup]:
        groups: dict[str, _OutGroup] = {}
        for t in trajs:
            meta, frames = t.to_wire()
            g = groups.get(t.group_id)
            if g is None:
                g = groups[t.group_id] = _OutGroup(t.group_id, [], 0)
            g.wire.append((meta, frames))
            g.nbytes += t.nbytes
        for g in groups.values():
            if g.nbytes > self.max_message_bytes - (1 << 20):
                raise ValueError(
                    f"group {g.group_id!r}: {g.nbytes} payload bytes cannot fit one message "
                    f"(buffer.max_message_bytes={self.max_message_bytes})"
                )
            if len(g.wire) > self.max_batch:
                raise ValueError(
                    f"group {g.group_id!r}: {len(g.metas)} trajectories > buffer.max_batch {self.max_batch}"
                )
        return list(groups.values())

    def _plan_messages(self, todo: list[_OutGroup]) -> list[list[_OutGroup]]:
        """Choose each group's shard (unless pinned), then pack groups into PUT messages that
        respect max_batch and put_message_bytes."""
        now = time.monotonic()
        by_shard: dict[int, list[_OutGroup]] = {}
        for g in todo:
            if not g.pinned:
                pinned = self._placement.get(g.group_id)
                g.shard, g.pinned = (
                    (pinned, True) if pinned is not None else (self._place(g.group_id, now), False)
                )
            by_shard.setdefault(g.shard, []).append(g)
        messages = []
        for groups in by_shard.values():
            current: list[_OutGroup] = []
            n = nbytes = 0
            for g in groups:
                if current and (
                    n + len(g.wire) > self.max_batch or nbytes + g.nbytes > self.put_message_bytes
                ):
                    messages.append(current)
                    current, n, nbytes = [], 0, 0
                current.append(g)
                n += len(g.wire)
                nbytes += g.nbytes
            messages.append(current)
        return messages

    def _place(self, group_id: str, now: float) -> int:
        """Shard of a new group: its home if that is up, else the first live one in its order."""
        home = shard_of(group_id, self.n_shards)
        if self.links[home].available(now):
            return home
        for k in fallback_order(group_id, self.n_shards):
            if self.links[k].available(now):
                self.rerouted_groups += 1
                return k
        return home  # nothing is up: wait for the home shard

    def _pin(self, g: _OutGroup) -> None:
        g.pinned = True
        self._placement[g.group_id] = g.shard
        self._placement.move_to_end(g.group_id)
        while len(self._placement) > PLACEMENT_MEMORY:
            self._placement.popitem(last=False)

    def _send_put(self, groups: list[_OutGroup]) -> Call:
        link = self.links[groups[0].shard]
        header = PutRequest(
            proto=PROTO_VERSION, id=link.next_id(), trajs=[m for g in groups for m in g.metas]
        )
        call = Call(header, [f for g in groups for f in g.frames], self.timeout_s)
        link.send(call)
        return call

    def _send_puts(self, messages: list[list[_OutGroup]]) -> list[tuple[list[_OutGroup], Call]]:
        """Send every message: through shared memory where the shard is on this host, else with
        frames. A same-host message goes at once into the region its shard reserved with our
        last PUT (`spare`), or after a RESERVE (sent for all such messages at once, their
        checksums computed while the replies come)."""
        sent, reserving, ready, releases = [], [], [], []
        now = time.monotonic()
        for groups in messages:
            link = self.links[groups[0].shard]
            link.pump_events()
            peer = link.peer
            if peer is None or any(g.frames_only for g in groups) or not self._worth_sharing(link, groups):
                sent.append((groups, self._send_put(groups)))
                continue
            payload = RegionPayload([w for g in groups for w in g.wire])
            peer.note_put_bytes(payload.nbytes)
            spare, release = peer.spare_for(payload.nbytes, now)
            releases += [self._release_call(link, peer, region) for region in release]
            if spare is not None:
                ready.append((groups, peer, spare.region, spare.segment, spare.offset, payload))
                continue
            call = Call(
                ReserveRequest(
                    proto=PROTO_VERSION, id=link.next_id(), nbytes=payload.nbytes, token=peer.token
                ),
                timeout_s=self.timeout_s,
                peer=peer,
            )
            link.send(call)
            self.reserve_requests += 1
            reserving.append((groups, call, payload))
        for groups, *at, payload in ready:
            sent.append((groups, self._put_region(groups, *at, payload)))
        for _, _, payload in reserving:
            payload.checksum  # noqa: B018 - (computed while the RESERVE replies are on their way)
        if reserving or releases:
            wait_all([call for _, call, _ in reserving] + releases, self.links)
            sent += [
                (groups, self._after_reserve(groups, call, payload)) for groups, call, payload in reserving
            ]
        return sent

    def _release_call(self, link: ShardLink, peer, region: int, timeout_s: float | None = None) -> Call:
        """Give back a region the shard reserved for us that we will not use (its outcome does
        not matter: an unreleased region expires; see `_release_spares`)."""
        call = Call(
            ReserveRequest(
                proto=PROTO_VERSION, id=link.next_id(), nbytes=0, token=peer.token, release=region
            ),
            timeout_s=timeout_s or self.timeout_s,
        )
        link.send(call)
        return call

    def _worth_sharing(self, link: ShardLink, groups: list[_OutGroup]) -> bool:
        least = self.same_host_min_put_bytes
        if least is None:
            least = link.peer.min_put_bytes
        return sum(g.nbytes for g in groups) >= max(1, least)

    def _after_reserve(self, groups: list[_OutGroup], reserve: Call, payload: RegionPayload) -> Call:
        """A reservation that failed is returned as the outcome (FULL: wait; lost or not sent:
        the PUT never left, retry), or the message goes as frames (the shard refused shared
        memory); else write and PUT."""
        link = reserve.link
        if isinstance(reserve.error, (NotSent, Lost)):
            reserve.error = NotSent(f"{link.name}: RESERVE failed ({reserve.error}); the PUT was not sent")
            return reserve
        if isinstance(reserve.error, BufferError) and reserve.error.code == "FULL":
            return reserve
        if isinstance(reserve.error, BufferError):
            if reserve.error.code == "NOT_SAME_HOST":
                link.peer_refused()
            return self._send_put(groups)
        region: ReserveReply = reserve.reply
        return self._put_region(groups, reserve.peer, region.region, region.segment, region.offset, payload)

    def _put_region(
        self, groups: list[_OutGroup], peer, region: int, segment: int, offset: int, payload: RegionPayload
    ) -> Call:
        """Write the arrays into the region and PUT the headers naming it (asking for the next
        region with it), or, if the file cannot be written, PUT them as frames."""
        link = self.links[groups[0].shard]
        try:
            peer.write(segment, offset, payload)
        except OSError as e:  # (the reservation expires on the shard)
            log.warning("%s: cannot write its shared segment (%s): using ZeroMQ", link.name, e)
            link.peer_refused()
            return self._send_put(groups)
        header = PutRequest(
            proto=PROTO_VERSION,
            id=link.next_id(),
            trajs=[m for g in groups for m in g.metas],
            region=region,
            region_checksum=payload.checksum,
            reserve_next=peer.next_put_bytes(),
        )
        call = Call(header, (), self.timeout_s, peer=peer)
        link.send(call)
        self.shared_put_bytes += sum(g.nbytes for g in groups)
        return call

    def _retry_delay(self, groups: list[_OutGroup]) -> float:
        """How long until any shard these groups may go to is worth trying again."""
        now = time.monotonic()
        if any(not g.pinned for g in groups) and any(link.available(now) for link in self.links):
            return 0.0
        shards = {g.shard for g in groups if g.pinned} or set(range(self.n_shards))
        return max(0.0, min(self.links[k].retry_at for k in shards) - now)

    def _wait_before_retry(
        self, wait_s: float, give_up: float, error: BaseException | None, full: bool
    ) -> None:
        if time.monotonic() + wait_s > give_up:
            if isinstance(error, BufferError):
                raise error
            raise ShardUnavailable(f"PUT gave up after {self.put_give_up_s:.1f}s: {error}") from error
        end = time.monotonic() + wait_s
        while True:
            if self.should_abort():
                raise PutAborted("PUT abandoned on request")
            left = end - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(left, 0.05))
        if full:
            self.backpressure_s += wait_s

    # -- consumer side: fifo -------------------------------------------------------------------

    def get(
        self,
        max_trajs: int,
        *,
        min_version: int = 0,
        policy_id: str = "default",
        wait_ms: int = 0,
        ack: LeasedBatch | None = None,
    ) -> LeasedBatch:
        """Lease up to `max_trajs` trajectories (whole groups; at least one group if any is
        available, even if larger). Waits up to `wait_ms` only when every live shard is empty
        (or none is up).

        `ack`: a batch used up, ACKed first, as `ack(batch)` would: its leases ride on the GETs
        to their shards (one round trip for both), the others go as ACKs. Its count is the
        returned batch's `acked`. If an ACK fails (raises as `ack` does), what this call leased
        is NACKed (given back) before it raises."""
        batch = LeasedBatch()
        deadline = time.monotonic() + wait_ms / 1000.0
        to_ack: dict[int, list[str]] = {}
        for shard, lease_id in ack.leases if ack is not None else ():
            to_ack.setdefault(shard, []).append(lease_id)
        carried: list[tuple[Call, list[str]]] = []
        try:
            while True:
                links = self._read_order()
                for link in links:
                    remaining = max_trajs - len(batch.trajs)
                    if remaining <= 0:
                        break
                    acks = to_ack.pop(link.index, [])
                    call = self._get_call(link, remaining, min_version, policy_id, 0, acks)
                    wait_all([call], self.links)
                    if acks:
                        carried.append((call, acks))
                        if call.error is not None:
                            continue  # (settled below, by ACKs)
                        batch.acked += call.reply.acked
                    self._take_lease(batch, call)
                if to_ack or carried:
                    self._settle_carried(batch, to_ack, carried)
                    to_ack, carried = {}, []
                left_ms = int((deadline - time.monotonic()) * 1000)
                if batch.trajs or left_ms <= 0:
                    return batch
                connected = [link for link in links if link.connected]
                if connected:
                    self._long_poll(connected, max_trajs, min_version, policy_id, left_ms, batch)
                else:
                    time.sleep(min(left_ms / 1000.0, self._time_to_next_probe()))
        except BaseException:
            if batch.leases:
                try:
                    self._settle(batch, NackRequest)
                except Exception as e:  # noqa: BLE001 - the first error is the one to raise
                    log.warning("could not give back %d leases: %s", len(batch.leases), e)
            raise

    def _settle_carried(
        self, batch: LeasedBatch, to_ack: dict[int, list[str]], carried: list[tuple[Call, list[str]]]
    ) -> None:
        """ACK what no GET carried, and again what a GET that failed carried (ACK is idempotent:
        a lease the lost GET did ACK answers `replayed`, with its count)."""
        leases = [(shard, lease_id) for shard, ids in to_ack.items() for lease_id in ids]
        for call, acks in carried:
            if call.error is not None:
                leases += [(call.link.index, lease_id) for lease_id in acks]
        if leases:
            batch.acked += self._settle(LeasedBatch(leases=leases), AckRequest)

    def _long_poll(
        self,
        links: list[ShardLink],
        max_trajs: int,
        min_version: int,
        policy_id: str,
        wait_ms: int,
        batch: LeasedBatch,
    ) -> None:
        """Park a GET on every link; the first lease wins, the others are cancelled."""
        polls = [self._get_call(link, max_trajs, min_version, policy_id, wait_ms) for link in links]
        finished: list[Call] = []
        cancelled = False

        def on_done(call: Call) -> list[Call]:
            nonlocal cancelled
            if not any(call is p for p in polls):
                return []
            finished.append(call)
            if cancelled or call.error is not None or not call.reply.lease_id:
                return []
            cancelled = True
            cancels = []
            for other in polls:
                if not other.done:
                    link = other.link
                    cancel = Call(
                        CancelRequest(proto=PROTO_VERSION, id=link.next_id(), target=other.header.id),
                        timeout_s=self.timeout_s,
                    )
                    link.send(cancel)
                    cancels.append(cancel)
            return cancels

        wait_all(polls, self.links, on_done)
        extra = LeasedBatch()
        for call in finished:
            fits = call.error is None and len(batch.trajs) + len(call.reply.trajs) <= max_trajs
            if fits or not batch.trajs:
                self._take_lease(batch, call)
            else:
                self._take_lease(extra, call)
        if extra.leases:
            self._settle(extra, NackRequest)
        batch.dropped_stale += extra.dropped_stale

    def _get_call(
        self,
        link: ShardLink,
        max_trajs: int,
        min_version: int,
        policy_id: str,
        wait_ms: int,
        ack: Sequence[str] = (),
    ) -> Call:
        link.pump_events()
        header = GetRequest(
            proto=PROTO_VERSION,
            id=link.next_id(),
            max_trajs=min(max_trajs, self.max_batch),
            min_version=min_version,
            policy_id=policy_id,
            wait_ms=wait_ms,
            token=link.peer.token if link.peer is not None else "",
            ack=list(ack),
        )
        call = Call(header, timeout_s=self.timeout_s + wait_ms / 1000.0, peer=link.peer)
        link.send(call)
        return call

    def _take_lease(self, batch: LeasedBatch, call: Call) -> None:
        if isinstance(call.error, BufferError):
            raise call.error
        if call.error is not None:
            return  # the shard is down or lost the request: its lease (if any) will expire
        reply: GetReply = call.reply
        batch.dropped_stale += reply.dropped_stale
        if reply.lease_id:
            batch.leases.append((call.link.index, reply.lease_id))
            batch.trajs.extend(self._trajectories(call))

    def _read_order(self) -> list[ShardLink]:
        """Live shards, starting one further each call (fairness)."""
        now = time.monotonic()
        start = self._next_read
        self._next_read = (self._next_read + 1) % self.n_shards
        order = [self.links[(start + i) % self.n_shards] for i in range(self.n_shards)]
        return [link for link in order if link.available(now)]

    def _time_to_next_probe(self) -> float:
        now = time.monotonic()
        return max(0.01, min(link.retry_at for link in self.links) - now)

    def ack(self, batch: LeasedBatch) -> int:
        """Delete the leased trajectories. Returns how many; raises (after settling every lease
        it can) if a lease was lost (expired, or its shard restarted) or stayed unreachable."""
        return self._settle(batch, AckRequest)

    def nack(self, batch: LeasedBatch) -> int:
        """Return the leased trajectories to the front of their queues."""
        return self._settle(batch, NackRequest)

    def _settle(self, batch: LeasedBatch, kind) -> int:
        todo = list(batch.leases)
        count = 0
        errors: list[BaseException] = []
        give_up = time.monotonic() + self.timeout_s
        while todo:
            calls = []
            for shard, lease_id in todo:
                link = self.links[shard]
                call = Call(
                    kind(proto=PROTO_VERSION, id=link.next_id(), lease_id=lease_id), timeout_s=self.timeout_s
                )
                link.send(call)
                calls.append(((shard, lease_id), call))
            wait_all([c for _, c in calls], self.links)
            retry = []
            for lease, call in calls:
                if call.error is None:
                    count += call.reply.count
                elif isinstance(call.error, BufferError):
                    errors.append(call.error)
                else:
                    retry.append((lease, call.error))
            todo = [lease for lease, _ in retry]
            if todo:
                wait_s = max(0.01, min(self.links[s].retry_at for s, _ in todo) - time.monotonic())
                if time.monotonic() + wait_s > give_up:
                    errors.extend(ShardUnavailable(f"{kind.__name__} gave up: {e}") for _, e in retry)
                    break
                time.sleep(wait_s)
        if errors:
            raise errors[0]
        return count

    # -- consumer side: replay -----------------------------------------------------------------

    def sample(
        self,
        n: int,
        *,
        policy_id: str = "default",
        min_version: int = 0,
        beta: float = 0.4,
        wait_ms: int = 0,
        seed: int | None = None,
    ) -> ReplayBatch:
        """Draw `n` groups with replacement from the replay shards (uniform or by priority,
        as the shards are configured), with importance weights. Groups older than
        `min_version` are dropped first. Returns fewer (or none) if a shard fails or nothing
        is stored; polls up to `wait_ms` for the first data."""
        deadline = time.monotonic() + wait_ms / 1000.0
        rng = self.rng if seed is None else np.random.default_rng(seed)
        while True:
            batch = self._sample_once(n, policy_id, min_version, beta, rng)
            if batch.trajs or n == 0 or time.monotonic() >= deadline:
                return batch
            time.sleep(min(0.02, max(0.0, deadline - time.monotonic())))

    def _sample_once(self, n: int, policy_id: str, min_version: int, beta: float, rng) -> ReplayBatch:
        links = self._read_order()
        out = ReplayBatch()
        if not links:
            return out
        if len(links) == 1:
            share = {links[0].index: 1.0}
            counts = None
            calls = {links[0].index: self._sample_call(links[0], n, policy_id, min_version, beta, rng)}
            wait_all(list(calls.values()), self.links)
        else:
            probes = {
                link.index: self._sample_call(link, 0, policy_id, min_version, beta, rng) for link in links
            }
            wait_all(list(probes.values()), self.links)
            masses = {k: c.reply.total_priority for k, c in probes.items() if c.error is None}
            counts = {k: c.reply.count for k, c in probes.items() if c.error is None}
            out.dropped_stale += sum(c.reply.dropped_stale for c in probes.values() if c.error is None)
            total = sum(masses.values())
            if total <= 0:
                out.count = sum(counts.values())
                return out
            shards = sorted(masses)
            share = {k: masses[k] / total for k in shards}
            alloc = rng.multinomial(n, [share[k] for k in shards])
            calls = {
                k: self._sample_call(self.links[k], int(m), policy_id, min_version, beta, rng)
                for k, m in zip(shards, alloc)
                if m > 0
            }
            wait_all(list(calls.values()), self.links)
        probs: list[float] = []
        per_traj: list[int] = []
        for k, call in calls.items():
            if isinstance(call.error, BufferError):
                raise call.error
            if call.error is not None:
                continue
            reply: SampleReply = call.reply
            out.dropped_stale += reply.dropped_stale
            out.trajs.extend(self._trajectories(call))
            for item in reply.items:
                out.refs.extend([SampleRef(k, item.key)] * item.size)
                probs.append(share[k] * item.prob)
                per_traj.append(item.size)
            if counts is None:
                counts = {k: reply.count}
        out.count = sum(counts.values()) if counts else 0
        p = np.asarray(probs, dtype=np.float64)
        if p.size:
            w = (out.count * p) ** (-beta)
            w /= w.max()
            out.probs = np.repeat(p, per_traj)
            out.weights = np.repeat(w, per_traj).astype(np.float32)
        return out

    def _sample_call(
        self, link: ShardLink, n: int, policy_id: str, min_version: int, beta: float, rng
    ) -> Call:
        link.pump_events()
        header = SampleRequest(
            proto=PROTO_VERSION,
            id=link.next_id(),
            n=n,
            min_version=min_version,
            policy_id=policy_id,
            beta=beta,
            seed=int(rng.integers(1 << 62)),
            token=link.peer.token if link.peer is not None and n > 0 else "",
        )
        call = Call(header, timeout_s=self.timeout_s, peer=link.peer if n > 0 else None)
        link.send(call)
        return call

    def _trajectories(self, call: Call) -> list[Trajectory]:
        """The trajectories of a GET or SAMPLE reply: views of the shard's files where it sent
        references, else of the payload frames."""
        reply = call.reply
        if call.header.token and reply.refs:
            trajs = call.peer.trajectories(reply.trajs, reply.refs, call.frames)
            self.shared_get_trajs += sum(r.segment >= 0 for r in reply.refs)
            return trajs
        if call.header.token and reply.trajs:
            call.link.peer_refused()  # the shard did not take the token: it restarted, or moved
        return from_wire_batch(reply.trajs, call.frames)

    def update_priorities(self, refs: Sequence[SampleRef], priorities: Sequence[float]) -> PriorityResult:
        """New priorities for sampled groups. `refs` and `priorities` are aligned (e.g. one per
        trajectory of a ReplayBatch); a group named several times gets the largest of its
        priorities. Shards that do not answer are skipped (counted in `unreached`)."""
        if len(refs) != len(priorities):
            raise ValueError(f"refs has {len(refs)} entries, priorities {len(priorities)}")
        best: dict[SampleRef, float] = {}
        for ref, p in zip(refs, priorities):
            best[ref] = max(float(p), best.get(ref, float("-inf")))
        by_shard: dict[int, list[tuple[int, float]]] = {}
        for ref, p in best.items():
            by_shard.setdefault(ref.shard, []).append((ref.key, p))
        calls = []
        for k, pairs in by_shard.items():
            link = self.links[k]
            for i in range(0, len(pairs), self.max_batch):
                chunk = pairs[i : i + self.max_batch]
                header = PriorityRequest(
                    proto=PROTO_VERSION,
                    id=link.next_id(),
                    keys=[key for key, _ in chunk],
                    priorities=[p for _, p in chunk],
                )
                call = Call(header, timeout_s=self.timeout_s)
                link.send(call)
                calls.append((len(chunk), call))
        wait_all([c for _, c in calls], self.links)
        result = PriorityResult()
        for size, call in calls:
            if isinstance(call.error, BufferError):
                raise call.error
            if call.error is not None:
                result.unreached += size
            else:
                result.updated += call.reply.updated
                result.unknown += call.reply.unknown
        return result

    # -- operations ----------------------------------------------------------------------------

    def stats(self, missing_ok: bool = False) -> list[StatsReply | None]:
        """STATS of every shard, in shard order, each tried until `timeout_s`. A shard that does
        not answer raises ShardUnavailable, or is None with `missing_ok`."""
        calls = self._ask_every_shard(
            lambda link: StatsRequest(proto=PROTO_VERSION, id=link.next_id()), self.timeout_s
        )
        out = []
        for call in calls:
            if isinstance(call.error, BufferError):
                raise call.error
            if call.error is not None and not missing_ok:
                raise ShardUnavailable(str(call.error)) from call.error
            out.append(call.reply if call.error is None else None)
        return out

    def ping(self, timeout_s: float = 1.0) -> bool:
        """True if every shard answers within `timeout_s`."""
        calls = self._ask_every_shard(
            lambda link: PingRequest(proto=PROTO_VERSION, id=link.next_id()), timeout_s
        )
        return all(c.error is None for c in calls)

    def _ask_every_shard(self, make_header: Callable[[ShardLink], object], timeout_s: float) -> list[Call]:
        """One request per shard, resent to shards that were down or lost it, until `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        calls: list[Call | None] = [None] * self.n_shards
        while True:
            todo = [k for k, c in enumerate(calls) if c is None or isinstance(c.error, (NotSent, Lost))]
            left = deadline - time.monotonic()
            if not todo or left <= 0:
                return calls
            for k in todo:
                if calls[k] is None or self.links[k].available(time.monotonic()):
                    calls[k] = Call(make_header(self.links[k]), timeout_s=max(0.01, left))
                    self.links[k].send(calls[k])
            wait_all([calls[k] for k in todo], self.links)
            if any(isinstance(calls[k].error, (NotSent, Lost)) for k in todo):
                time.sleep(min(max(0.0, deadline - time.monotonic()), self._time_to_next_probe()))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._release_spares()
        for link in self.links:
            link.close()
        if self._own_ctx:
            self.ctx.term()

    def _release_spares(self) -> None:
        """Give back the regions shards reserved for PUTs that will not come (best effort: an
        unreleased one expires after reserve_timeout_s, and its segment file is then deleted
        rather than reused)."""
        calls = []
        for link in self.links:
            peer = link.peer
            if peer is not None:
                calls += [self._release_call(link, peer, r, timeout_s=0.5) for r in peer.take_spares()]
        if calls:
            wait_all(calls, self.links)

    def __enter__(self) -> BufferClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _refused_region(call: Call) -> bool:
    """A same-host PUT refused for its region (not written as it says, expired, used)."""
    return (
        isinstance(call.header, PutRequest)
        and call.header.region is not None
        and isinstance(call.error, BufferError)
        and call.error.code == "BAD_PAYLOAD"
    )


def _is_full(error: BaseException | None) -> bool:
    return isinstance(error, BufferError) and error.code == "FULL"


class PutPipeline:
    """PUTs that do not wait for their replies: `put` sends and returns while up to `window`
    PUT messages are in flight (it waits for the oldest beyond that), so a producer prepares
    (same host: writes) its next PUT while the shard checks and logs the last one. Every reply
    is still awaited: those of PUTs that fail are sent again (as `BufferClient.put` does:
    FULL, a down shard, a lost reply; pinned where they may have gone), synchronously.

    A trajectory is acknowledged by the buffer only once the PUT carrying it was answered:
    what a `put` call returns counts the PUTs answered during it (maybe earlier calls'), and
    `flush()` (or leaving the `with` block) waits for every one. If the producer dies before,
    PUTs not yet answered may or may not be stored (a resend is deduped). Not thread-safe;
    flush before closing the client."""

    def __init__(self, client: BufferClient, window: int) -> None:
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
        self.client = client
        self.window = window
        self.in_flight: deque[tuple[list[_OutGroup], Call]] = deque()

    def put(self, trajs: Sequence[Trajectory]) -> PutReply:
        """Send `trajs`; return once at most `window` PUT messages are unanswered, with the
        counts of those answered meanwhile."""
        client = self.client
        total = PutReply(proto=PROTO_VERSION, id=0)
        self._settle_done(total)
        self.in_flight.extend(client._send_puts(client._plan_messages(client._out_groups(trajs))))
        self._settle(total, keep=self.window)
        return total

    def flush(self) -> PutReply:
        """Wait until every PUT sent is answered (and, if it failed, stored by a retry)."""
        total = PutReply(proto=PROTO_VERSION, id=0)
        self._settle(total, keep=0)
        return total

    def _settle(self, total: PutReply, keep: int) -> None:
        while len(self.in_flight) > keep:
            wait_all([self.in_flight[0][1]], self.client.links)
            self._settle_done(total)

    def _settle_done(self, total: PutReply) -> None:
        """Account for the finished PUTs (in any order); retry the failed ones to the end."""
        done = [sent for sent in self.in_flight if sent[1].done]
        if not done:
            return
        self.in_flight = deque(sent for sent in self.in_flight if not sent[1].done)
        retries = [self.client._harvest([sent], total)[0] for sent in done]
        for retry in retries:  # (each as it was sent: together they might not fit the shard)
            if retry:
                self.client._put_groups(retry, total)

    def __enter__(self) -> PutPipeline:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.flush()


class PutBatcher:
    """Producer-side batching: collects whole groups from many small `add` calls and PUTs them
    together once `max_trajs` trajectories or `max_bytes` payload bytes are waiting, or the
    oldest has waited `linger_s` (checked at each `add`; there is no background thread).

    A trajectory is acknowledged by the buffer only when the PUT carrying it returns: when an
    `add` returns a PutReply, or at `flush()` / leaving the `with` block. Until then it lives
    only in this process. Not thread-safe."""

    def __init__(self, client: BufferClient, *, max_trajs: int, max_bytes: int, linger_s: float) -> None:
        self.client = client
        self.max_trajs = max_trajs
        self.max_bytes = max_bytes
        self.linger_s = linger_s
        self.pending: list[Trajectory] = []
        self.pending_bytes = 0
        self.first_at = 0.0

    def add(self, trajs: Sequence[Trajectory]) -> PutReply | None:
        if not self.pending:
            self.first_at = time.monotonic()
        self.pending.extend(trajs)
        self.pending_bytes += sum(t.nbytes for t in trajs)
        if (
            len(self.pending) >= self.max_trajs
            or self.pending_bytes >= self.max_bytes
            or time.monotonic() - self.first_at >= self.linger_s
        ):
            return self.flush()
        return None

    def flush(self) -> PutReply:
        if not self.pending:
            return PutReply(proto=PROTO_VERSION, id=0)
        reply = self.client.put(self.pending)
        self.pending, self.pending_bytes = [], 0
        return reply

    def __enter__(self) -> PutBatcher:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.flush()
