"""The buffer's client library: what rollout services and learners use to reach the shards
(`BufferClient`). This module is the facade and the
consumer side (GET/ACK/NACK, SAMPLE/PRIORITY, STATS); the producer side is `puts.py`, shard
choice `placement.py`, the same-host data plane `same_host_client.py`, one shard connection
`link.py`. The rules it follows and why: docs/architecture.md (Buffer: Client) and
docs/protocol.md (Writing a client).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import zmq

from sluice.buffer.holder import Holder
from sluice.buffer.link import Backoff, Call, Lost, NotSent, ShardLink, wait_all, wait_out
from sluice.buffer.placement import Placement, ShardUnavailable, fallback_order, shard_of
from sluice.buffer.puts import PutAborted, PutBatcher, PutPipeline, PutSender, PutSettings
from sluice.buffer.same_host_client import reply_trajectories
from sluice.config.buffer import BufferConfig
from sluice.rpc import RpcError as BufferError
from sluice.rpc import RpcTimeout as BufferTimeout
from sluice.trajectory import Trajectory
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
    Request,
    SampleReply,
    SampleRequest,
    StatsReply,
    StatsRequest,
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
    "fallback_order",
    "shard_of",
]

log = logging.getLogger(__name__)


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


class BufferClient:
    """Every shard of one buffer, as one: `put` (and `pipeline`, `batcher`) for producers,
    `get`/`ack`/`nack` (fifo) or `sample`/`update_priorities` (replay) for consumers, `stats`
    and `ping` for operations. Not thread-safe: one client per thread."""

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
        holder: Holder | None = None,
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
        self._closed = False
        self.timeout_s = timeout_s
        self.should_abort = should_abort
        self.max_batch = max_batch
        self.holder = holder or Holder.anonymous()  # named on every GET (see buffer/holder.py)
        self.rng = np.random.default_rng(seed)
        self._placement = Placement(self.links)
        settings = PutSettings(
            timeout_s=timeout_s,
            put_give_up_s=put_give_up_s,
            should_abort=should_abort,
            max_batch=max_batch,
            max_message_bytes=max_message_bytes,
            put_message_bytes=min(put_message_bytes, max_message_bytes // 2),
            same_host_min_put_bytes=same_host_min_put_bytes,
        )
        self._puts = PutSender(self.links, self._placement, settings)
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

    def reachable(self, shard: int) -> bool:
        """Whether a request to `shard` would be sent now: False once its connection went down
        and until it is back (a request would be refused, `NotSent`, and an ACK retried until
        then); True while a new connection is still being made (a request waits for it)."""
        link = self.links[shard]
        link.pump_events()
        return not link.lost

    # -- producer side (puts.py) ---------------------------------------------------------------

    def put(self, trajs: Sequence[Trajectory]) -> PutReply:
        """Store trajectories (whole groups) on their shards; wait out backpressure and down
        shards (docs/architecture.md, Buffer: Client). Returns the summed accepted/duplicates
        counts. If it raises, groups on other shards may have been stored: calling `put` again
        with the same trajectories is safe (they are deduped, and pinned to where they may have
        gone)."""
        return self._puts.put(trajs)

    def pipeline(self, window: int = 2) -> PutPipeline:
        """PUTs that do not wait for their replies, up to `window` in flight (see PutPipeline)."""
        return PutPipeline(self._puts, window)

    def batcher(self, max_trajs: int = 256, max_bytes: int = 4 << 20, linger_s: float = 0.05) -> PutBatcher:
        """Collects small PUTs into larger ones (see PutBatcher)."""
        return PutBatcher(self._puts, max_trajs=max_trajs, max_bytes=max_bytes, linger_s=linger_s)

    @property
    def backpressure_s(self) -> float:
        """Total time PUTs spent waiting on full shards."""
        return self._puts.backpressure_s

    @property
    def rerouted_groups(self) -> int:
        """New groups stored away from their home shard (it was down)."""
        return self._placement.rerouted_groups

    @property
    def shared_put_bytes(self) -> int:
        """Payload bytes PUT through shared memory (same host)."""
        return self._puts.shared.shared_put_bytes

    @property
    def reserve_requests(self) -> int:
        """RESERVE round trips (most same-host PUTs need none)."""
        return self._puts.shared.reserve_requests

    # -- consumer side: fifo -------------------------------------------------------------------

    def get(
        self,
        max_trajs: int,
        *,
        min_version: int = 0,
        policy_id: str = "default",
        wait_ms: int = 0,
        ack: LeasedBatch | None = None,
        ack_patience_s: float | None = None,
    ) -> LeasedBatch:
        """Lease up to `max_trajs` trajectories (whole groups; at least one group if any is
        available, even if larger). Waits up to `wait_ms` only when every live shard is empty
        (or none is up).

        `ack`: a batch used up, ACKed first, as `ack(batch)` would: its leases ride on the GETs
        to their shards (one round trip for both), the others go as ACKs. Its count is the
        returned batch's `acked`. If an ACK fails (raises as `ack` does), what this call leased
        is NACKed (given back) before it raises. `ack_patience_s`: how long an ACK whose shard
        is unreachable is retried before `ShardUnavailable` (default: `timeout_s`; 0: sent once)."""
        batch = LeasedBatch()
        deadline = time.monotonic() + wait_ms / 1000.0
        to_ack: dict[int, list[str]] = {}
        for shard, lease_id in ack.leases if ack is not None else ():
            to_ack.setdefault(shard, []).append(lease_id)
        carried: list[tuple[Call, list[str]]] = []
        try:
            while True:
                links = self._placement.read_order()
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
                    self._settle_carried(batch, to_ack, carried, ack_patience_s)
                    to_ack, carried = {}, []
                left_ms = int((deadline - time.monotonic()) * 1000)
                if batch.trajs or left_ms <= 0:
                    return batch
                connected = [link for link in links if link.connected]
                if connected:
                    self._long_poll(connected, max_trajs, min_version, policy_id, left_ms, batch)
                else:
                    time.sleep(min(left_ms / 1000.0, self._placement.time_to_next_probe()))
        except BaseException:
            if batch.leases:
                try:
                    self._settle(batch, NackRequest)
                except Exception as e:  # noqa: BLE001 - the first error is the one to raise
                    log.warning("could not give back %d leases: %s", len(batch.leases), e)
            raise

    def _settle_carried(
        self,
        batch: LeasedBatch,
        to_ack: dict[int, list[str]],
        carried: list[tuple[Call, list[str]]],
        patience_s: float | None,
    ) -> None:
        """ACK what no GET carried, and again what a GET that failed carried (ACK is idempotent:
        a lease the lost GET did ACK answers `replayed`, with its count)."""
        leases = [(shard, lease_id) for shard, ids in to_ack.items() for lease_id in ids]
        for call, acks in carried:
            if call.error is not None:
                leases += [(call.sent_on().index, lease_id) for lease_id in acks]
        if leases:
            batch.acked += self._settle(LeasedBatch(leases=leases), AckRequest, patience_s)

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
                    link = other.sent_on()
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
            holder=self.holder.name,
            incarnation=self.holder.incarnation,
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
            batch.leases.append((call.sent_on().index, reply.lease_id))
            batch.trajs.extend(self._trajectories(call))

    def ack(self, batch: LeasedBatch) -> int:
        """Delete the leased trajectories. Returns how many; raises (after settling every lease
        it can) if a lease was lost (expired, or its shard restarted) or stayed unreachable."""
        return self._settle(batch, AckRequest)

    def nack(self, batch: LeasedBatch) -> int:
        """Return the leased trajectories to the front of their queues."""
        return self._settle(batch, NackRequest)

    def _settle(self, batch: LeasedBatch, kind, patience_s: float | None = None) -> int:
        todo = list(batch.leases)
        count = 0
        errors: list[BaseException] = []
        give_up = time.monotonic() + (self.timeout_s if patience_s is None else patience_s)
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
                # a role that stops gives up here rather than wait out the timeout for a shard
                # that is gone: a lease that shard never hears of comes back when it expires (a
                # learner whose launcher was killed by SIGKILL waited 30 s for its last ACKs)
                if time.monotonic() + wait_s > give_up or wait_out(wait_s, self.should_abort):
                    errors.extend(ShardUnavailable(f"{kind.__name__} gave up: {e}") for _, e in retry)
                    break
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
        links = self._placement.read_order()
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
        """The trajectories of a GET or SAMPLE reply (views of the shard's files where it sent
        references, else of the payload frames)."""
        trajs, shared = reply_trajectories(call)
        self.shared_get_trajs += shared
        return trajs

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

    def _ask_every_shard(self, make_header: Callable[[ShardLink], Request], timeout_s: float) -> list[Call]:
        """One request per shard, resent to shards that were down or lost it, until `timeout_s`
        or until `should_abort` (calls still open then end Abandoned; unsent ones stay NotSent)."""
        deadline = time.monotonic() + timeout_s
        calls: list[Call | None] = [None] * self.n_shards
        while True:
            todo = [k for k, c in enumerate(calls) if c is None or isinstance(c.error, (NotSent, Lost))]
            left = deadline - time.monotonic()
            if not todo or left <= 0 or (None not in calls and self.should_abort()):
                asked = [c for c in calls if c is not None]
                if len(asked) < len(calls):
                    raise ValueError(f"timeout_s={timeout_s}: no time left to ask the shards")
                return asked
            for k in todo:
                if calls[k] is None or self.links[k].available(time.monotonic()):
                    call = calls[k] = Call(make_header(self.links[k]), timeout_s=max(0.01, left))
                    self.links[k].send(call)
            sent = [c for k in todo if (c := calls[k]) is not None]  # every one of them, now
            wait_all(sent, self.links, should_abort=self.should_abort)
            if any(isinstance(c.error, (NotSent, Lost)) for c in sent):
                next_try = min(max(0.0, deadline - time.monotonic()), self._placement.time_to_next_probe())
                wait_out(next_try, self.should_abort)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._puts.shared.release_spares()
        for link in self.links:
            link.close()
        if self._own_ctx:
            self.ctx.term()

    def __enter__(self) -> BufferClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
