"""Learner side of weight sync: keep the group's membership current, then publish a version.

Every learner rank calls `publish` in lockstep (the others only gather sharded weights); rank 0
serves the store and the snapshot server, forms membership epochs, and sends, via
weight_sync.pipeline. The protocol, its failure rules and its timings are in
docs/architecture.md, "Weight sync".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch
import zmq
from prometheus_client import CollectorRegistry

from sluice.config.weight_sync import WeightSyncConfig
from sluice.weight_sync.announcements import (
    CONTROL_KEY,
    HEAD_KEY,
    KEEP_ANNOUNCEMENTS,
    NOTICE_KEY,
    TRANSFER_KEY,
    Announcement,
    EpochAnnouncement,
    EpochCommit,
    ShutdownAnnouncement,
    WeightsAnnouncement,
    ann_key,
    encoder,
    epoch_key,
)
from sluice.weight_sync.buffers import BufferPool
from sluice.weight_sync.checksums import WIRE_CHECKSUMS, XXH3, piece_wsum
from sluice.weight_sync.group import (
    BroadcastGroup,
    CollectiveAborted,
    CollectiveError,
    FormationAbandoned,
    TCPStore,
    epoch_backend,
    make_group,
    new_client,
    open_store,
    resolve_backend,
)
from sluice.weight_sync.layout import (
    TORCH_DTYPES,
    Bucket,
    TensorSpec,
    describe,
    empty_bucket,
    encode_checksums,
    pack_bucket,
    plan_buckets,
)
from sluice.weight_sync.membership import Candidate, Membership
from sluice.weight_sync.metrics import BroadcastMetrics, PublishStats
from sluice.weight_sync.notices import NoticePublisher
from sluice.weight_sync.pipeline import Piece, PiecePipeline, Producer, SendSums, flat_pieces
from sluice.weight_sync.snapshot import Snapshot
from sluice.weight_sync.source import ParamSource, source_for
from sluice.weight_sync.transfer_server import SnapshotServer

log = logging.getLogger(__name__)

_FORM_TRIES = 3  # epochs formed in a row while members leave or go silent during the connect


class MembershipHost(Protocol):
    """Where receivers send JOIN / LEAVE / SYNC_REPORT (sluice.control.server.ControlServer)."""

    def attach_membership(self, registry: Membership) -> None: ...


class _Liveness:
    """Polled while the learner waits on a broadcast or an epoch's confirmations: reads the
    heartbeat counters of `ranks` in `epoch` (at most twice a second) and says abort when one
    has not moved for `timeout_s` (`silent`: those ranks)."""

    def __init__(self, store: TCPStore, epoch: int, ranks: Iterable[int], timeout_s: float) -> None:
        self.store = store
        self.keys = {rank: epoch_key(epoch, "beat", rank) for rank in ranks}
        self.timeout_s = timeout_s
        now = time.monotonic()
        self.seen: dict[int, tuple[int, float]] = {rank: (-1, now) for rank in self.keys}
        self.checked = 0.0
        self.silent: list[int] = []

    @classmethod
    def of(cls, store: TCPStore, group: BroadcastGroup, timeout_s: float) -> _Liveness:
        """Every member of `group` (ranks 1..world-1; the learner is rank 0)."""
        return cls(store, group.epoch, range(1, group.world_size), timeout_s)

    def __call__(self) -> bool:
        now = time.monotonic()
        if now - self.checked < 0.5:
            return bool(self.silent)
        self.checked = now
        for rank, key in self.keys.items():
            beats = self.store.add(key, 0)
            last, since = self.seen[rank]
            if beats != last:
                self.seen[rank] = (beats, now)
            elif now - since > self.timeout_s and rank not in self.silent:
                self.silent.append(rank)
        return bool(self.silent)


class SilentMembers(CollectiveError):
    """Members of epoch `epoch` (by rank) whose heartbeat stopped for `liveness_timeout_s`
    during a publish or the group's connect: crashed or hung. The next epoch is formed without
    them at once."""

    def __init__(self, message: str, epoch: int, ranks: list[int]) -> None:
        super().__init__(message)
        self.epoch = epoch
        self.ranks = tuple(ranks)


@dataclass
class _Sent:
    """How one publish's sends went (for its PublishStats)."""

    members: int  # the group's members when it was sent
    bytes: int  # sent over the group
    delta_tensors: int  # tensors a delta sent; -1: sent in full
    retried: bool  # the first send failed and the snapshot went again over a new epoch
    delivered: bool  # sent without a failure (`confirm: wait`: and every member reported it)


class WeightBroadcaster:
    def __init__(
        self,
        cfg: WeightSyncConfig,
        device: torch.device,
        model_dtype: str = "float32",
        *,
        learner_rank: int = 0,
        zmq_ctx: zmq.Context | None = None,
    ) -> None:
        self.cfg = cfg
        self.zmq_ctx = zmq_ctx  # for the snapshot server; a secure context with security.curve
        self.device = device
        self.wire_dtype = TORCH_DTYPES[model_dtype if cfg.dtype == "auto" else cfg.dtype]
        self.learner_rank = learner_rank
        self.backend = resolve_backend(cfg.backend, device)
        self.membership = Membership()
        self.metrics = BroadcastMetrics(None)
        self.store: TCPStore | None = None
        self._connect_store: TCPStore | None = None  # the client epochs' group connects use
        self.transfer: SnapshotServer | None = None
        self.notices: NoticePublisher | None = None  # wakes receivers after a store write
        self.group: BroadcastGroup | None = None
        self.snapshot: Snapshot | None = None
        self._layout: list[Bucket] | None = None
        self._specs: list[TensorSpec] | None = None
        self._source: tuple[object, ParamSource] | None = None
        self._members: list[str] = []  # the current epoch's members, in rank order
        self._committed: list[Candidate] = []  # the same, with their incarnations
        self._committed_epoch = -1  # the epoch they were committed to
        self._silent: set[Candidate] = set()  # members found silent: left out of the next epoch
        self._broken = False  # the current epoch's group failed: form a new one before sending
        self._abandoned_works: list = []  # of a failed publish, dropped together with its group
        self._droppers: list = []  # threads releasing dropped groups
        # host buffers of retired snapshots (one version's worth), page-locked for accelerators
        self._host_buffers = BufferPool(torch.device("cpu"), pin=device.type != "cpu")
        self._force_full = True  # members may lack the delta base (new epoch, a refusal)
        self._phases = (0.0, 0.0)  # the last _send's (send, confirm) seconds
        # the checksum thread, kept across publishes (ChecksumWorker)
        self._hash_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync-checksums")
        # `confirm: background`: the members' reports of the last version, awaited here
        self._confirm_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync-confirm")
        self._confirming: Future | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(
        self,
        control: MembershipHost | None = None,
        control_endpoint: str | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        """Serve the store and the snapshot server (rank 0). Returns at once: receivers join
        whenever they come up. `control`: the control server that answers JOIN / LEAVE /
        SYNC_REPORT with this broadcaster's membership; `control_endpoint`: its address,
        advertised to receivers not configured with one; `registry`: Prometheus metrics."""
        if self.learner_rank != 0:
            return
        if registry is not None:
            self.metrics = BroadcastMetrics(registry)
        if control is not None:
            control.attach_membership(self.membership)
        self.store = open_store(self.cfg.master_addr, self.cfg.master_port, True, self.cfg.timeout_s)
        # a connect holds its client while it waits on keys, and membership writes go on
        self._connect_store = new_client(self.store)
        self.transfer = SnapshotServer(self.cfg.transfer, self.cfg.master_addr, ctx=self.zmq_ctx)
        self.transfer.start()
        self.notices = NoticePublisher(self.zmq_ctx or zmq.Context.instance(), self.cfg.master_addr)
        self.store.set(HEAD_KEY, b"0")
        self.store.set(TRANSFER_KEY, self.transfer.endpoint.encode())
        self.store.set(NOTICE_KEY, self.notices.endpoint.encode())
        if control_endpoint is not None:
            self.store.set(CONTROL_KEY, control_endpoint.encode())
        log.info(
            "weight sync: store :%d, snapshots at %s, backend %s",
            self.cfg.master_port,
            self.transfer.endpoint,
            self.backend,
        )

    def close(self, leave_wait_s: float = 3.0) -> None:
        self._hash_pool.shutdown(wait=True)
        if self.store is None:
            return
        self._finish_confirm()
        self._confirm_pool.shutdown(wait=True)
        self.announce_shutdown()
        deadline = time.monotonic() + leave_wait_s
        while self.membership.registered() and time.monotonic() < deadline:
            time.sleep(0.05)  # receivers LEAVE when they read the shutdown
        self._drop_group()
        for dropper in self._droppers:  # a group torn down at interpreter exit aborts it
            dropper.join(timeout=min(10.0, self.cfg.publish_timeout_s))
        if self.transfer is not None:
            self.transfer.close()
            self.transfer = None
        if self.notices is not None:
            self.notices.close()
            self.notices = None
        self.store = None

    def announce_shutdown(self) -> None:
        """Tell every receiver that nothing more will be published (once): members read the
        announcement and LEAVE; a service that JOINs from now on is told so in the reply."""
        if not self.membership.shutting_down:
            self._announce(self.membership.shutdown_seq(), ShutdownAnnouncement())

    def _live_store(self) -> TCPStore:
        """The store rank 0 serves from start() to close()."""
        if self.store is None:
            raise RuntimeError("weight sync: no store (rank 0 serves it from start() to close())")
        return self.store

    # -- publishing ----------------------------------------------------------------------------

    def publish(
        self,
        version: int,
        model: torch.nn.Module | ParamSource,
        on_confirmed: Callable[[int], None] | None = None,
    ) -> PublishStats:
        """Deliver `version` of the weights to every member (rank 0) or take part in gathering
        them (other learner ranks). Never raises for a receiver's failure. `on_confirmed(v)`
        is called once every member verified `v`: before returning (`confirm: wait`), or from
        the confirmation thread (`background`: this returns when the sends are done; with
        `send: background` as soon as `v` is packed, and the stats say `pending`)."""
        t0 = time.perf_counter()
        source = self._source_for(model)
        layout = self._plan(source)
        if self.learner_rank != 0:
            self._gather_only(layout, source)
            return PublishStats(version, 0, time.perf_counter() - t0, 0, 0)
        assert self.store is not None, "start() first"
        self._finish_confirm()
        self._handle_reports()
        if self.membership.needs_epoch() or self._broken:
            self._form_epoch()
        if self.cfg.send == "background" and self.group is not None:
            return self._publish_later(version, layout, source, on_confirmed, t0)
        later = self.cfg.confirm == "background" and self.group is not None
        snapshot, sent = self._deliver(version, layout, source, confirm=not later)
        if sent.delivered and later and not sent.retried:
            group = self.group
            if group is None:  # `later` saw one, and a delivered publish keeps it
                raise RuntimeError("weight sync: the group went away during a delivered publish")
            self._confirming = self._confirm_pool.submit(self._confirm, group, version, on_confirmed)
        elif on_confirmed is not None:  # undelivered too: members pull the snapshot from here
            on_confirmed(version)
        return self._settle(snapshot, sent, t0)

    def _publish_later(
        self,
        version: int,
        layout: list[Bucket],
        source: ParamSource,
        on_confirmed: Callable[[int], None] | None,
        t0: float,
    ) -> PublishStats:
        """`send: background`: pack `version` into its host snapshot here (the model may change
        once this returns); the confirmation thread sends it, awaits the members' reports and
        keeps it. The next publish (or close) waits for that first, so the two never share the
        broadcaster's state."""
        snapshot = self._build_snapshot(version, layout, source, send=False)[0]
        members = self.group.world_size - 1 if self.group is not None else 0
        self._confirming = self._confirm_pool.submit(self._send_later, snapshot, on_confirmed, t0)
        elapsed = time.perf_counter() - t0
        return PublishStats(version, 0, elapsed, members, self.membership.epoch, pending=True)

    def _send_later(
        self, snapshot: Snapshot, on_confirmed: Callable[[int], None] | None, t0: float
    ) -> CollectiveError | None:
        """The confirmation thread's half of `_publish_later`: a delivery failure was already
        retried over a new epoch here, so there is nothing left for the next publish to mend."""
        members = self.group.world_size - 1 if self.group is not None else 0
        if self.cfg.delta:
            error, nbytes, delta_tensors = self._send_delta(snapshot, confirm=True)
        else:
            error, nbytes, delta_tensors = self._send_full(snapshot), snapshot.nbytes, -1
        sent = _Sent(members, nbytes, delta_tensors, retried=False, delivered=True)
        sent = self._resend_on_failure(snapshot, error, sent)
        if on_confirmed is not None:  # undelivered too: members pull the snapshot from here
            on_confirmed(snapshot.version)
        self._settle(snapshot, sent, t0)
        return None

    def _settle(self, snapshot: Snapshot, sent: _Sent, t0: float) -> PublishStats:
        """After a version's delivery: keep its snapshot (late joiners pull it, the next delta
        starts from it), count it published and record its stats."""
        if sent.delivered and sent.delta_tensors < 0:
            self._force_full = False
        self._keep_snapshot(snapshot)
        self.membership.set_published(snapshot.version)
        stats = PublishStats(
            version=snapshot.version,
            bytes=sent.bytes if (self.group is not None and sent.delivered) else 0,
            seconds=time.perf_counter() - t0,
            members=sent.members if sent.delivered else 0,
            epoch=self.membership.epoch,
            delta_tensors=sent.delta_tensors,
            retried=sent.retried,
            delivered=sent.delivered,
            send_seconds=self._phases[0],
            confirm_seconds=self._phases[1],
        )
        self.metrics.published(stats)
        return stats

    def _deliver(
        self, version: int, layout: list[Bucket], source: ParamSource, confirm: bool
    ) -> tuple[Snapshot, _Sent]:
        """Pack `version` into a snapshot and send it (only what changed, with `delta`); if
        that fails, abandon the epoch and send the snapshot in full over a new one, once."""
        members = self.group.world_size - 1 if self.group else 0
        if self.cfg.delta:
            snapshot = self._build_snapshot(version, layout, source, send=False)[0]
            error, nbytes, delta_tensors = self._send_delta(snapshot, confirm=confirm)
        else:
            snapshot, error = self._build_snapshot(version, layout, source, send=True, confirm=confirm)
            nbytes, delta_tensors = snapshot.nbytes, -1
        sent = _Sent(members, nbytes, delta_tensors, retried=False, delivered=True)
        return snapshot, self._resend_on_failure(snapshot, error, sent)

    def _resend_on_failure(self, snapshot: Snapshot, error: CollectiveError | None, sent: _Sent) -> _Sent:
        """`sent` when the first send worked; else the snapshot in full over a new epoch, once."""
        if error is None:
            return sent
        self._abandon_epoch(error)
        self._form_epoch()
        members = self.group.world_size - 1 if self.group else 0
        error = self._send_full(snapshot)
        if error is not None:
            self._abandon_epoch(error)
        return _Sent(members, snapshot.nbytes, -1, retried=True, delivered=error is None)

    def _keep_snapshot(self, snapshot: Snapshot) -> None:
        """`snapshot` is what late joiners pull and the next delta's base from now on."""
        retired, self.snapshot = self.snapshot, snapshot
        if self.transfer is not None:
            self.transfer.publish(snapshot)
        if retired is not None:
            self._host_buffers.retire(retired.flats)  # reused once no pull holds a view of it

    def _source_for(self, model: torch.nn.Module | ParamSource) -> ParamSource:
        if self._source is None or self._source[0] is not model:
            self._source = (model, source_for(model))
        return self._source[1]

    def _plan(self, source: ParamSource) -> list[Bucket]:
        specs = source.specs()
        if self._layout is None or specs != self._specs:
            self._specs = specs
            self._layout = plan_buckets(specs, int(self.cfg.bucket_mb * 2**20), cast_to=self.wire_dtype)
            log.info("weight sync layout: %s", describe(self._layout))
        return self._layout

    def _gather_only(self, layout: list[Bucket], source: ParamSource) -> None:
        """Non-zero learner ranks: the same gathers, in the same order, as rank 0."""
        for bucket in layout:
            with source.gather(bucket.names):
                pass

    def _build_snapshot(
        self, version: int, layout: list[Bucket], source: ParamSource, *, send: bool, confirm: bool = True
    ) -> tuple[Snapshot, CollectiveError | None]:
        """Gather and pack bucket by bucket into a host snapshot, broadcasting each piece as
        soon as it is packed when `send` (and there is a group)."""
        flats: list[torch.Tensor] = []
        on_host = self.device.type == "cpu"
        wire_on_host = self._wire_device().type == "cpu"

        def produce(
            i: int, bucket: Bucket, bounds: list[tuple[int, int]], wire_sums: bool
        ) -> Iterator[Piece]:
            host = self._host_buffers.get(bucket)
            out = host if on_host else empty_bucket(bucket, self.device)
            flats.append(host)
            with source.gather(bucket.names) as full:
                for lo, hi in bounds:
                    pack_bucket(bucket, full, out, lo, hi)  # cast where the weights live
                    wsum = piece_wsum(out[lo:hi], lo) if wire_sums else None  # on the device
                    if not on_host:
                        host[lo:hi].copy_(out[lo:hi])
                    yield (host if wire_on_host else out)[lo:hi], host[lo:hi], wsum

        error, sums = self._send(version, layout, produce, None, send=send, confirm=confirm)
        return Snapshot(version, layout, flats, sums), error

    def _wire_device(self) -> torch.device:
        """Where broadcast tensors must live: the host for gloo (a CPU transport: handing it
        accelerator tensors only adds a staging copy per piece), else the learner's device."""
        if self.group is None or self.group.backend == "gloo":
            return torch.device("cpu")
        return self.device

    def _wire_checksum(self) -> str:
        """xxh3 per tensor where the bytes pass through host memory (gloo), wsum32 per piece
        computed on the device where they do not (nccl, hccl): see weight_sync.checksums."""
        if self.cfg.checksum != "auto":
            return self.cfg.checksum
        return "xxh3" if self._wire_device().type == "cpu" else "wsum32"

    def _send_full(self, snapshot: Snapshot, confirm: bool = True) -> CollectiveError | None:
        wire_device = self._wire_device()

        def produce(
            i: int, bucket: Bucket, bounds: list[tuple[int, int]], wire_sums: bool
        ) -> Iterator[Piece]:
            return flat_pieces(snapshot.flats[i], bounds, wire_device, wire_sums)

        return self._send(snapshot.version, snapshot.buckets, produce, snapshot.sums, confirm=confirm)[0]

    def _send_delta(self, snapshot: Snapshot, confirm: bool) -> tuple[CollectiveError | None, int, int]:
        """(error, bytes sent, tensors sent). Full when members may lack the base."""
        base = self.snapshot
        if base is None or self._force_full:
            return self._send_full(snapshot, confirm), snapshot.nbytes, -1
        changed = {t.name: t for t in snapshot.tensors() if base.checksum_of(t.name) != t.checksum}
        if self.group is None:
            return None, 0, len(changed)  # nobody to send to; the snapshot is what counts
        specs = [TensorSpec(t.name, tuple(t.shape), TORCH_DTYPES[t.dtype]) for t in changed.values()]
        layout = plan_buckets(specs, int(self.cfg.bucket_mb * 2**20))
        sums = [[changed[n].checksum for n in bucket.names] for bucket in layout]
        wire_device = self._wire_device()

        def produce(
            i: int, bucket: Bucket, bounds: list[tuple[int, int]], wire_sums: bool
        ) -> Iterator[Piece]:
            packed = pack_bucket(bucket, {n: changed[n].data for n in bucket.names}, empty_bucket(bucket))
            return flat_pieces(packed, bounds, wire_device, wire_sums)

        error, _ = self._send(
            snapshot.version, layout, produce, sums, base_version=base.version, confirm=confirm
        )
        return error, sum(b.nbytes for b in layout), len(changed)

    def _send(
        self,
        version: int,
        layout: list[Bucket],
        produce: Producer,
        sums: list[list[int]] | None,
        base_version: int = -1,
        *,
        send: bool = True,
        confirm: bool = True,
    ) -> tuple[CollectiveError | None, list[list[int]]]:
        """Announce `version` (when `send` and there is a group), produce and broadcast its
        buckets piece by piece (PiecePipeline) with their checksums where the wire checksum
        says (SendSums), then await the members' reports unless `confirm` is off (`_confirm`
        does it in the background). `sums`: the buckets' xxh3 when known; None: hashed from
        the pieces' host copies. Returns (error, every bucket's xxh3)."""
        group = self.group if send else None
        t_start = time.perf_counter()
        piece_bytes = max(1, int(self.cfg.piece_mb * 2**20))
        wire = WIRE_CHECKSUMS[self._wire_checksum()] if group is not None else XXH3
        append = None
        if group is not None:
            seq = self.membership.next_seq(version)
            self._announce(
                seq, WeightsAnnouncement(group.epoch, version, layout, base_version, piece_bytes, wire.name)
            )
            append = self._sums_appender(seq)
        liveness = _Liveness.of(self._live_store(), group, self.cfg.liveness_timeout_s) if group else None
        pipeline = PiecePipeline(group, self.cfg.pipeline_depth, self.cfg.publish_timeout_s, liveness)
        hashed = pipeline.send(layout, produce, SendSums(wire, append, sums, self._hash_pool), piece_bytes)
        error = pipeline.error
        t_sent = time.perf_counter()
        if error is None and group is not None and liveness is not None and confirm:  # else: _confirm
            error = self._await_reports(group, version, liveness)
        self._phases = (t_sent - t_start, time.perf_counter() - t_sent)
        if error is not None:
            if group is not None and liveness is not None and liveness.silent:
                note = "" if "heartbeat" in str(error) else f": no heartbeat from rank(s) {liveness.silent}"
                error = SilentMembers(f"{error}{note}", group.epoch, liveness.silent)
            self._abandoned_works.append(pipeline.pending())  # released with the group, not here
        return error, hashed

    def _sums_appender(self, seq: int) -> Callable[[int, list[int]], None]:
        """Appends a bucket's checksums to announcement `seq`'s sums (called from the hashing
        thread when xxh3 sums follow the data)."""
        store = self.store
        assert store is not None, "start() first"
        key = ann_key(seq, "sums")
        written = bytearray()  # what the key holds: each notice carries all of it
        lock = threading.Lock()

        def append(i: int, bucket_sums: list[int]) -> None:
            words = encode_checksums(bucket_sums)
            with lock:
                store.append(key, words)
                written.extend(words)
                self._notify(key, bytes(written))

        return append

    def _confirm(
        self, group: BroadcastGroup, version: int, on_confirmed: Callable[[int], None] | None
    ) -> CollectiveError | None:
        """The confirmation thread (`confirm: background`): the members' reports of `version`
        while the learner trains on. The main thread uses the store only after
        `_finish_confirm`, so the two never share it."""
        error = self._await_reports(
            group, version, _Liveness.of(self._live_store(), group, self.cfg.liveness_timeout_s)
        )
        if error is None and on_confirmed is not None:
            on_confirmed(version)
        return error

    def _finish_confirm(self) -> None:
        """Wait for the last background confirmation (normally done long ago). A member that
        failed it breaks the epoch: the next publish forms a new one and sends in full."""
        if self._confirming is None:
            return
        error, self._confirming = self._confirming.result(), None
        if error is not None:
            self._abandon_epoch(error)
            self._force_full = True

    def _await_reports(
        self, group: BroadcastGroup, version: int, liveness: _Liveness
    ) -> CollectiveError | None:
        """A publish is complete when every member verified it (or refused it: a data problem,
        not a group problem). Our side of the broadcast finishing is not enough: in a tree a
        member may have lost the data another member was to forward."""
        deadline = time.monotonic() + self.cfg.publish_timeout_s
        while True:
            outcomes = self.membership.wait_reports(group.epoch, version, self._members, 0.25)
            failed = [sid for sid, outcome in outcomes.items() if outcome == "failed"]
            if failed:
                return CollectiveError(f"{failed} failed to receive v{version}")
            if len(outcomes) == len(self._members):
                return None
            if liveness():
                return SilentMembers(
                    f"no heartbeat from rank(s) {liveness.silent} after v{version}",
                    group.epoch,
                    liveness.silent,
                )
            if time.monotonic() > deadline:
                missing = sorted(set(self._members) - set(outcomes))
                return CollectiveError(
                    f"{missing} did not confirm v{version} within {self.cfg.publish_timeout_s}s"
                )

    # -- membership epochs ---------------------------------------------------------------------

    def _handle_reports(self) -> None:
        """Receivers' refusals force the next publish to be full; a failed collective on a
        member's side means the group is broken even if ours succeeded."""
        for report in self.membership.take_problems():
            self.metrics.reported(report.outcome)
            log.warning(
                "weight sync: %s %s version %d (epoch %d): %s",
                report.service_id,
                report.outcome,
                report.version,
                report.epoch,
                report.error,
            )
            self._force_full = True
            if report.outcome == "failed" and self.group is not None and report.epoch == self.group.epoch:
                self._broken = True

    def _form_epoch(self) -> None:
        """Form the next epoch's group. A member that leaves while the group connects (its
        LEAVE, or its launcher's for its dead process) ends that connect at once, and the next
        epoch forms without it, a few times at most."""
        for _ in range(_FORM_TRIES):
            if self._try_form_epoch():
                return

    def _try_form_epoch(self) -> bool:
        """False when the group's connect was given up on (the epoch is abandoned)."""
        self._drop_group()
        self._broken = False
        self._force_full = True
        seq, epoch, candidates = self._begin_epoch()
        self._announce(seq, EpochAnnouncement(epoch, [c.service_id for c in candidates]))
        ready = self._await_ready(epoch, candidates)
        committed = [c for c in candidates if ready.get(c.service_id) == c.incarnation]
        dropped = [c for c in candidates if c not in committed]
        ids = [c.service_id for c in committed]
        self._members, self._committed, self._committed_epoch = ids, committed, epoch
        backend = epoch_backend(self.cfg.backend, self.device.type, [c.device for c in committed])
        commit = encoder.encode(EpochCommit(epoch, ids, backend))
        self._live_store().set(epoch_key(epoch, "commit"), commit)
        self._notify(epoch_key(epoch, "commit"), commit)
        self.membership.commit_epoch(committed, dropped)
        if dropped:
            log.warning(
                "weight sync: epoch %d leaves out %s (not confirmed: gone, silent in the last epoch, "
                "or not within %.1fs)",
                epoch,
                [c.service_id for c in dropped],
                self.cfg.ready_timeout_s,
            )
        if not committed:
            log.info("weight sync: epoch %d has no members", epoch)
            return True
        return self._connect_epoch(epoch, committed, backend)

    def _connect_epoch(self, epoch: int, committed: list[Candidate], backend: str) -> bool:
        """Form epoch `epoch`'s group with its committed members; False when the connect was
        given up on (a member left, or its heartbeat stopped: SIGSTOPped or hung between
        confirming and connecting) and the epoch abandoned."""
        ranks = range(1, len(committed) + 1)
        liveness = _Liveness(self._live_store(), epoch, ranks, self.cfg.liveness_timeout_s)
        try:
            self.group = make_group(
                backend,
                self._connect_client(),
                0,
                len(committed) + 1,
                epoch=epoch,
                prefix=epoch_key(epoch, "pg", ""),
                connect_timeout_s=self.cfg.ready_timeout_s,
                op_timeout_s=self.cfg.publish_timeout_s,
                should_abort=lambda: not all(self.membership.holds(c) for c in committed) or liveness(),
            )
        except FormationAbandoned:
            self._connect_store = new_client(self._live_store())  # the abandoned connect holds the old
            self._abandon_epoch(self._connect_given_up(epoch, committed, liveness))
            return False
        except CollectiveError as e:
            self._abandon_epoch(e)
            return True
        log.info("weight sync: epoch %d formed with %s over %s", epoch, self._members, backend)
        return True

    def _connect_given_up(self, epoch: int, committed: list[Candidate], liveness: _Liveness) -> Exception:
        """Why a connect was given up on: members that left, or whose heartbeat stopped (a
        member stopped between confirming and connecting: SilentMembers, which
        `_abandon_epoch` leaves out of the next epoch at once, as after a publish)."""
        gone = [c.service_id for c in committed if not self.membership.holds(c)]
        silent = [committed[rank - 1].service_id for rank in liveness.silent]
        parts = [f"{gone} left"] if gone else []
        parts += [f"{silent} went silent"] if silent else []
        message = f"{' and '.join(parts) or 'gave up'} while the group connected"
        return SilentMembers(message, epoch, liveness.silent) if silent else CollectiveAborted(message)

    def _begin_epoch(self) -> tuple[int, int, list[Candidate]]:
        """The next epoch's announcement seq, number and candidates: every registered service
        but the members found silent in the last one (crashed or hung), forgotten at once
        instead of waited for; they JOIN again if they come back."""
        left_out, self._silent = self._silent, set()
        seq, epoch, candidates = self.membership.begin_epoch(leave_out=left_out)
        if left_out:
            log.warning(
                "weight sync: epoch %d leaves out %s at once (no heartbeat in epoch %d)",
                epoch,
                sorted(c.service_id for c in left_out),
                self._committed_epoch,
            )
        return seq, epoch, candidates

    def _await_ready(self, epoch: int, candidates: list[Candidate]) -> dict[str, str]:
        """service id -> incarnation of the candidates that confirmed in time. Not waited for: a
        candidate that left meanwhile (its LEAVE, or its launcher's for its dead process), and one
        that was a member of the last epoch whose heartbeat there has not moved for
        `liveness_timeout_s` (a crash the failed collective did not name)."""
        if not candidates:
            return {}
        keys = {c: epoch_key(epoch, "ready", c.service_id) for c in candidates}
        old_rank = {c: r for r, c in enumerate(self._committed, 1) if c in keys}
        store = self._live_store()
        watch = _Liveness(store, self._committed_epoch, old_rank.values(), self.cfg.liveness_timeout_s)
        deadline = time.monotonic() + self.cfg.ready_timeout_s
        while True:
            waiting = [c for c, k in keys.items() if not store.check([k]) and self.membership.holds(c)]
            if not waiting or time.monotonic() >= deadline:
                break
            if watch() and all(old_rank.get(c) in watch.silent for c in waiting):
                break
            time.sleep(0.01)
        present = [k for k in keys.values() if store.check([k])]
        by_key = dict(zip(present, store.multi_get(present) if present else []))
        return {c.service_id: by_key[k].decode() for c, k in keys.items() if k in by_key}

    def _abandon_epoch(self, error: Exception) -> None:
        epoch = self.group.epoch if self.group is not None else self.membership.epoch
        log.warning("weight sync: epoch %d abandoned: %s", epoch, error)
        if isinstance(error, SilentMembers) and error.epoch == self._committed_epoch:
            self._silent |= {self._committed[r - 1] for r in error.ranks if 0 < r <= len(self._committed)}
        self._live_store().set(epoch_key(epoch, "abort"), b"1")
        self._notify()
        self._drop_group()
        self._broken = True
        self.membership.count("failures")
        self.metrics.failed()

    def _drop_group(self) -> None:
        if self.group is not None:
            self._droppers = [d for d in self._droppers if d.is_alive()]
            self._droppers.append(self.group.close(pending=self._abandoned_works))
            self._abandoned_works = []
            self.group = None

    def _connect_client(self) -> TCPStore:
        """The store client group connects use: made at start, and again once a connect was
        abandoned, not on the way to a connect (`new_client`)."""
        if self._connect_store is None:
            raise RuntimeError("weight sync: start() first")
        return self._connect_store

    def _notify(self, key: str = "", value: bytes = b"") -> None:
        """Wake the receivers: a key they wait on was just written; with `key`, the notice
        carries the value it now holds (weight_sync/notices.py)."""
        if self.notices is not None:
            self.notices.notify(key, value)

    def _announce(self, seq: int, announcement: Announcement) -> None:
        """The announcement's key, then its notice, then the head: a receiver reads the head
        only to tell that an announcement it waits for was pruned."""
        store = self._live_store()
        value = encoder.encode(announcement)
        store.set(ann_key(seq), value)
        self._notify(ann_key(seq), value)
        store.set(HEAD_KEY, str(seq + 1).encode())
        old = seq - KEEP_ANNOUNCEMENTS
        if old >= 0:
            store.delete_key(ann_key(old))
            store.delete_key(ann_key(old, "sums"))
