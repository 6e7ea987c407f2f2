"""Rollout side of weight sync: a thread that keeps a verified copy of the newest weights.

It joins the learner's membership, follows the store's announcements, receives each version
into fresh buffers (never the live model: generation goes on meanwhile), verifies it, and
hands verified versions to the rollout loop (`take_latest`); anything wrong refuses the whole
version. Every wait has a timeout and `stop()` ends it promptly. The protocol and its failure
rules are in docs/architecture.md, "Weight sync".
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import zmq

from sluice.config.weight_sync import WeightSyncConfig
from sluice.control.client import ControlClient
from sluice.control.messages import SyncOutcome
from sluice.rpc import RpcError, RpcTimeout
from sluice.weight_sync.announcements import (
    CONTROL_KEY,
    HEAD_KEY,
    NOTICE_KEY,
    TRANSFER_KEY,
    EpochAnnouncement,
    ShutdownAnnouncement,
    WeightsAnnouncement,
    ann_key,
    announcement_decoder,
    commit_decoder,
    epoch_key,
)
from sluice.weight_sync.buffers import BufferPool
from sluice.weight_sync.checksums import WIRE_CHECKSUMS, WSUM32, WireChecksum
from sluice.weight_sync.group import (
    BroadcastGroup,
    CollectiveAborted,
    CollectiveError,
    FormationAbandoned,
    TCPStore,
    make_group,
    new_client,
    open_store,
    wait_work,
)
from sluice.weight_sync.layout import decode_checksums, piece_bounds, unpack_bucket
from sluice.weight_sync.notices import NoticeListener
from sluice.weight_sync.transfer_client import TransferError, pull_snapshot

log = logging.getLogger(__name__)

_POLL_S = 0.2  # how often waits look at stop() and the abort key


@dataclass
class ReceivedWeights:
    version: int
    tensors: list[tuple[str, torch.Tensor]]  # every tensor of the model (views; never mutated)


class _Rejoin(Exception):
    """This receiver is not (or no longer) in the learner's membership: pull and JOIN again."""


class WeightReceiver:
    def __init__(
        self,
        cfg: WeightSyncConfig,
        service_id: str,
        device: torch.device = torch.device("cpu"),
        *,
        control_endpoint: str | None = None,
        zmq_ctx: zmq.Context | None = None,
        expected: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        """`service_id`: who this receiver is in the membership (one per rollout service).
        `control_endpoint`: where to JOIN; None: the endpoint the learner advertises in the
        store. Group ranks come from the membership epochs. `expected` (name -> shape), when
        given, is checked against every layout: unknown names, wrong shapes, or missing names
        refuse the version."""
        self.cfg = cfg
        self.service_id = service_id
        self.incarnation = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.control_endpoint = control_endpoint
        self.zmq_ctx = zmq_ctx  # None: plain sockets; a secure context with security.curve
        self.device = device
        self.expected = {k: list(v) for k, v in expected.items()} if expected is not None else None
        self.error: BaseException | None = None
        self.version = -1  # newest verified version held
        self.epoch = 0  # epoch of the group it is in (0: none)
        self.refused_versions = 0
        self.failures = 0
        self.pulls = 0
        self.finished = threading.Event()  # shutdown announced, or failed
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._latest: ReceivedWeights | None = None
        # The held version's tensors, kept only as the base of deltas (`delta: true`): once
        # the rollout loop took and loaded a version, the engine holds the only other copy.
        self._current: dict[str, torch.Tensor] = {}
        self._group: BroadcastGroup | None = None
        self._droppers: list[threading.Thread] = []  # threads releasing dropped groups
        self._buffers = BufferPool(device)
        # a gloo epoch with weights on an accelerator: received into page-locked host buffers,
        # verified there, then copied to the device once
        self._host_buffers = (
            self._buffers if device.type == "cpu" else BufferPool(torch.device("cpu"), pin=True)
        )
        self._registered = False
        self._listed = False  # an epoch listed it since it last joined
        self._seq = 0
        self._last_pull = 0.0
        self._last_beat = 0.0  # when _wait_once last bumped this member's heartbeat
        self._store: TCPStore | None = None
        self._watch: TCPStore | None = None  # see _watch_store
        self._notices: NoticeListener | None = None  # the learner's store-change notices
        self._control: ControlClient | None = None
        self._thread = threading.Thread(target=self._run, name="weight-receiver", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _watch_store(self) -> TCPStore:
        """A second client of the learner's store, for the checks made while the first may be
        held by a group's connect (which waits on keys holding its client's lock). Made with
        the first, not on the way to a connect (`new_client`)."""
        if self._watch is None:
            raise RuntimeError("weight receiver: not connected to the learner's store")
        return self._watch

    def _live_store(self) -> TCPStore:
        """The learner's store, which the receiver thread connects to first."""
        if self._store is None:
            raise RuntimeError("weight receiver: not connected to the learner's store")
        return self._store

    def _live_notices(self) -> NoticeListener:
        """The listener on the learner's notices, made once the store names them."""
        if self._notices is None:
            raise RuntimeError("weight receiver: not listening to the learner's notices")
        return self._notices

    def _live_control(self) -> ControlClient:
        """The control-plane client, made once the store names the control server."""
        if self._control is None:
            raise RuntimeError("weight receiver: no control-plane client yet")
        return self._control

    def stop(self, timeout_s: float = 5.0) -> None:
        """Leave the group and end the thread (waits up to `timeout_s` for it)."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=timeout_s)

    def take_latest(self) -> ReceivedWeights | None:
        """The newest verified version not yet taken (older untaken ones are skipped)."""
        with self._lock:
            latest, self._latest = self._latest, None
            return latest

    def held(self) -> ReceivedWeights | None:
        """The newest verified version (taken or not), when kept as a delta base."""
        with self._lock:
            if self.version < 0 or not self._current:
                return None
            return ReceivedWeights(self.version, list(self._current.items()))

    def wait_for_weights(self, timeout_s: float) -> ReceivedWeights | None:
        with self._arrived:
            self._arrived.wait_for(
                lambda: self._latest is not None or self.finished.is_set(), timeout=timeout_s
            )
            latest, self._latest = self._latest, None
            return latest

    # -- thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        shutdown = False
        try:
            host, port = self.cfg.master_addr, self.cfg.master_port
            self._store = open_store(host, port, False, self.cfg.timeout_s, self._stop.is_set)
            self._watch = new_client(self._store)  # made now: not on the way to a connect
            ctx = self.zmq_ctx or zmq.Context.instance()
            self._notices = NoticeListener(ctx, self._store.get(NOTICE_KEY).decode())
            endpoint = self.control_endpoint or self._store.get(CONTROL_KEY).decode()
            self._control = ControlClient(endpoint, timeout_s=min(10.0, self.cfg.timeout_s), ctx=self.zmq_ctx)
            shutdown = self._follow()
        except BaseException as e:  # noqa: BLE001 - surfaced to the rollout loop via .error
            if not self._stop.is_set():
                log.exception("weight receiver failed")
                self.error = e
        finally:
            self._drop_group()
            for dropper in self._droppers:  # groups torn down at interpreter exit abort it
                dropper.join(timeout=min(10.0, self.cfg.publish_timeout_s))
            if self._registered and self._control is not None:
                self._leave(shutdown)
            if self._control is not None:
                self._control.close()
            if self._notices is not None:
                self._notices.close()
            with self._arrived:
                self.finished.set()
                self._arrived.notify_all()

    def _follow(self) -> bool:
        """Follow the announcements until shutdown (True) or stop (False)."""
        while not self._stop.is_set():
            try:
                if not self._registered:
                    if self._join():
                        return True  # the learner shut down before this JOIN
                    continue
                announcement = self._next_announcement()
                if announcement is None:
                    return False
                if isinstance(announcement, ShutdownAnnouncement):
                    log.info("weight receiver: the learner announced shutdown")
                    return True
                if isinstance(announcement, EpochAnnouncement):
                    self._enter_epoch(announcement)
                elif self._group is not None and announcement.epoch == self._group.epoch:
                    self._receive(self._seq - 1, announcement, self._group)
                else:
                    self._catch_up(announcement.version)
            except _Rejoin as why:
                if self._stop.is_set():
                    break  # still registered: the LEAVE on the way out removes it
                log.info("weight receiver: joining again (%s)", why)
                self._drop_group()
                self._registered = False
        return False

    # -- membership ----------------------------------------------------------------------------

    def _join(self) -> bool:
        """Pull the current version if newer than what is held, then JOIN. True: the learner
        announced its shutdown before the JOIN (not registered; nothing more will come)."""
        self._pull()
        deadline = time.monotonic() + self.cfg.timeout_s
        while not self._stop.is_set():
            try:
                reply = self._live_control().join(
                    self.service_id, self.incarnation, self.version, self.device.type, pid=os.getpid()
                )
                break
            except RpcTimeout:
                if time.monotonic() > deadline:
                    raise
        else:
            return False
        if reply.shutting_down:
            log.info("weight receiver: %s: the learner is shutting down; not joining", self.service_id)
            return True
        self._seq = reply.seq
        self._registered = True
        self._listed = False
        log.info(
            "weight receiver: %s joined (holds v%d; epoch %d, next announcement %d)",
            self.service_id,
            self.version,
            reply.epoch,
            reply.seq,
        )
        if reply.published_version > self.version:
            self._pull()  # published between the pull and the JOIN
        if reply.announced_version > self.version:
            # announced before the JOIN, so sent to an epoch without this receiver and not
            # announced again: pull it once its send settles (`send: background` widens this)
            self._catch_up(reply.announced_version)
        return False

    def _catch_up(self, version: int) -> None:
        """A version went out over a group this receiver is not in (it joined after the epoch
        formed, or its group failed): pull it once the learner finished publishing it, rather
        than generate with older weights until the next epoch. Gives up when a newer
        announcement comes (the next epoch may list it)."""
        deadline = time.monotonic() + self.cfg.publish_timeout_s
        while self.version < version and not self._stop.is_set() and time.monotonic() < deadline:
            self._pull()
            if self.version >= version or int(self._live_store().get(HEAD_KEY)) > self._seq:
                return
            time.sleep(0.05)

    def _pull(self) -> None:
        """The late joiner's path: the learner's snapshot over ZeroMQ, if newer than held."""
        self._last_pull = time.monotonic()
        endpoint = self._live_store().get(TRANSFER_KEY).decode()
        try:
            pulled = pull_snapshot(
                endpoint,
                self.cfg.transfer,
                newer_than=self.version,
                device=self.device,
                should_stop=self._stop.is_set,
                ctx=self.zmq_ctx,
            )
        except TransferError as e:
            if not self._stop.is_set():
                log.warning(
                    "weight receiver: pull from %s failed (%s); keeping v%d", endpoint, e, self.version
                )
            return
        if pulled is None:
            return
        self.pulls += 1
        log.info(
            "weight receiver: pulled v%d (%.1f MiB in %.2fs)",
            pulled.version,
            pulled.nbytes / 2**20,
            pulled.seconds,
        )
        problem = self._layout_problem(pulled.version, pulled.tensors, full=True)
        if problem:
            self._refuse(0, pulled.version, problem)
            return
        self._accept(pulled.version, pulled.tensors)
        self._report(0, pulled.version, "ok")

    def _leave(self, shutdown: bool) -> None:
        self._live_control().timeout_s = 2.0  # best effort: the learner may be gone
        try:
            self._live_control().leave(self.service_id, self.incarnation)
        except (RpcTimeout, RpcError) as e:
            if not shutdown:
                log.warning("weight receiver: LEAVE not acknowledged: %s", e)

    def _enter_epoch(self, ann: EpochAnnouncement) -> None:
        if self.service_id not in ann.candidates:
            if self._listed:  # the learner removed it (left out of a commit, or replaced)
                raise _Rejoin(f"epoch {ann.epoch} does not list {self.service_id}")
            return  # joined after this epoch's candidates were chosen: the next one lists it
        self._listed = True
        self._drop_group()
        self._live_store().set(epoch_key(ann.epoch, "ready", self.service_id), self.incarnation.encode())
        wait_s = 2 * self.cfg.ready_timeout_s + self.cfg.publish_timeout_s
        commit = commit_decoder.decode(self._wait_key(epoch_key(ann.epoch, "commit"), wait_s))
        if self.service_id not in commit.members:
            raise _Rejoin(f"left out of epoch {ann.epoch}")
        rank = commit.members.index(self.service_id) + 1
        try:
            self._group = make_group(
                commit.backend,
                self._live_store(),
                rank,
                len(commit.members) + 1,
                epoch=ann.epoch,
                prefix=epoch_key(ann.epoch, "pg", ""),
                connect_timeout_s=self.cfg.ready_timeout_s,
                op_timeout_s=self.cfg.publish_timeout_s,
                should_abort=self._abandoned(ann.epoch, rank),  # reads on the watch client
            )
        except FormationAbandoned as e:  # the learner gave the epoch up (a member left) or we stop
            log.info("weight receiver: %s", e)
            # the abandoned connect still waits on its keys, holding this client's lock: the
            # watch client takes over, and a new one watches
            watch = self._watch_store()
            self._store, self._watch = watch, new_client(watch)
            return
        except CollectiveError as e:
            self.failures += 1
            log.warning("weight receiver: %s", e)
            self._report(ann.epoch, self.version, "failed", str(e))
            return
        self.epoch = ann.epoch
        log.info(
            "weight receiver: %s is rank %d of %d in epoch %d",
            self.service_id,
            rank,
            len(commit.members) + 1,
            ann.epoch,
        )

    def _drop_group(self, pending: list | None = None) -> None:
        if self._group is not None:
            self._droppers = [d for d in self._droppers if d.is_alive()]
            dropper = self._group.close(pending)
            if dropper is not None:
                self._droppers.append(dropper)
            self._group = None
            self.epoch = 0

    # -- store waits ---------------------------------------------------------------------------

    def _next_announcement(self):
        key = ann_key(self._seq)
        while not self._stop.is_set():
            value = self._wait_once(key)
            if value is not None:
                self._seq += 1
                return announcement_decoder.decode(value)
            if int(self._live_store().get(HEAD_KEY)) > self._seq and not self._live_store().check([key]):
                raise _Rejoin(f"announcement {self._seq} was pruned: fell behind")
            if self.version < 0 and self._group is None and time.monotonic() - self._last_pull > 1.0:
                self._pull()  # holds nothing and is not in a group yet: do not wait for an epoch
        return None

    def _wait_key(self, key: str, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        while (value := self._wait_once(key)) is None:
            if self._stop.is_set():
                raise _Rejoin("stopping")
            if time.monotonic() > deadline:
                raise _Rejoin(f"{key} not written within {timeout_s:.0f}s")
        return value

    def _wait_once(self, key: str) -> bytes | None:
        """`key`'s value if it is written within _POLL_S (`_look`), else None. A member bumps
        its heartbeat at most every _POLL_S."""
        now = time.monotonic()
        if self._group is not None and now - self._last_beat >= _POLL_S:
            self._last_beat = now  # idle members beat too: the learner may still be sending
            self._live_store().add(epoch_key(self._group.epoch, "beat", self._group.rank), 1)
        return self._look(key, now + _POLL_S)

    def _look(
        self, key: str, deadline: float, enough: Callable[[bytes], bool] = lambda _: True
    ) -> bytes | None:
        """`key`'s value once one that is `enough` came in a notice or is in the store; None at
        `deadline`. The store is looked at as `NoticeListener.look_every_s` says (not with a
        store `wait`: one that times out logs a C++ warning each time). DistNetworkError
        (learner gone) propagates."""
        notices, store = self._live_notices(), self._live_store()
        notices.wait(0)  # what came while this thread was busy
        next_look = time.monotonic() + notices.look_every_s()
        while True:
            value = notices.carried(key)
            if value is not None and enough(value):
                return value
            now = time.monotonic()
            if now >= next_look:
                next_look = now + notices.look_every_s()
                if store.check([key]) and enough(value := store.get(key)):
                    return value
            if now >= deadline:
                return None
            notices.wait((deadline if next_look <= now else min(deadline, next_look)) - now)

    def _wait_sums(self, seq: int, count: int, abandoned: Callable[[], bool]) -> list[int]:
        """The first `count` checksums of announcement `seq`. The learner appends a bucket's
        once it hashed it, while the data is on the wire: usually they are there already."""
        key = ann_key(seq, "sums")
        deadline = time.monotonic() + self.cfg.publish_timeout_s
        while True:
            raw = self._look(key, min(time.monotonic() + _POLL_S, deadline), lambda v: len(v) >= 8 * count)
            if raw is not None:
                return decode_checksums(raw)
            if abandoned():
                raise CollectiveAborted("abandoned while waiting for checksums")
            if time.monotonic() >= deadline:
                raise CollectiveError(
                    f"checksums of announcement {seq} not written within {self.cfg.publish_timeout_s:.0f}s"
                )

    def _abandoned(self, epoch: int, rank: int) -> Callable[[], bool]:
        """Polled while waiting in a collective: bump this member's heartbeat (the learner
        watches it), and give up if the learner abandoned the epoch or we are stopping."""

        def check() -> bool:
            store = self._watch_store()
            store.add(epoch_key(epoch, "beat", rank), 1)
            return self._stop.is_set() or store.check([epoch_key(epoch, "abort")])

        return check

    # -- versions ------------------------------------------------------------------------------

    def _receive(self, seq: int, ann: WeightsAnnouncement, group: BroadcastGroup) -> None:
        """Receive version `ann.version` over `group` (this receiver's) into fresh buffers and
        verify it; accept it, or refuse it whole and keep the held version."""
        pool = self._host_buffers if group.backend == "gloo" else self._buffers
        flats = [pool.get(b) for b in ann.buckets]
        wire = WIRE_CHECKSUMS.get(ann.checksum)
        bad = [] if wire is not None else [f"checksum {ann.checksum!r} unknown to this receiver"]
        wire = wire or WSUM32  # received all the same: the group's collectives stay in step
        works: list = []
        try:
            bad += self._receive_pieces(seq, ann, group, flats, wire, works)
        except CollectiveError as e:
            self._drop_group(pending=[works, flats])
            self.failures += 1
            log.warning("weight receiver: v%d over epoch %d failed: %s", ann.version, ann.epoch, e)
            self._report(ann.epoch, ann.version, "failed", str(e))
            return
        if bad:
            pool.retire(flats)
            self._refuse(
                ann.epoch, ann.version, f"checksum mismatch in {len(bad)} {wire.unit}, e.g. {bad[:3]}"
            )
            return
        tensors = self._unpack(ann, pool, flats)
        if ann.base_version >= 0 and ann.base_version != self.version:
            why = f"delta on v{ann.base_version}, this receiver holds v{self.version}"
            self._refuse(ann.epoch, ann.version, why)
            return
        if ann.base_version >= 0:
            tensors = self._merge(tensors)
        problem = self._layout_problem(ann.version, tensors, full=True)
        if problem:
            self._refuse(ann.epoch, ann.version, problem)
            return
        self._accept(ann.version, tensors)
        self._report(ann.epoch, ann.version, "ok")

    def _receive_pieces(
        self,
        seq: int,
        ann: WeightsAnnouncement,
        group: BroadcastGroup,
        flats: list[torch.Tensor],
        wire: WireChecksum,
        works: list,
    ) -> list[str]:
        """Post every piece's broadcast at once (their works go to `works`), then check each
        piece as it arrives while the next ones are received, and compare a bucket's sums
        with the learner's once its last piece is in. Returns what differs: tensors (xxh3)
        or pieces (wsum32). Raises CollectiveError."""
        abandoned = self._abandoned(ann.epoch, group.rank)
        pieces = [
            [(lo, flat[lo:hi]) for lo, hi in piece_bounds(bucket, ann.piece_bytes)]
            for bucket, flat in zip(ann.buckets, flats)
        ]
        works.extend(group.broadcast_async(piece) for bucket_pieces in pieces for _, piece in bucket_pieces)
        arrived = iter(works)
        expected: list[int] = []  # the learner's sums so far
        first = 0  # index of the bucket's first sum among them
        bad: list[str] = []
        for i, (bucket, bucket_pieces) in enumerate(zip(ann.buckets, pieces)):
            check = wire.checker(bucket, i)  # xxh3 per tensor on the host; wsum32 per piece
            for lo, piece in bucket_pieces:
                wait_work(next(arrived), self.cfg.publish_timeout_s, abandoned, _POLL_S)
                check.update(piece, lo)  # verified while the next pieces arrive
            got = check.sums
            end = first + len(got)
            if len(expected) < end:
                expected = self._wait_sums(seq, end, abandoned)
            bad += [label for label, g, e in zip(check.labels, got, expected[first:end]) if g != e]
            first = end
        return bad

    def _unpack(
        self, ann: WeightsAnnouncement, pool: BufferPool, flats: list[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The verified buckets as named views, on the receiver's device (host-staged buckets
        are moved there once)."""
        if pool is not self._buffers:
            staged, flats = flats, [f.to(self.device) for f in flats]
            pool.retire(staged)
            pool = self._buffers
        tensors = {n: t for b, f in zip(ann.buckets, flats) for n, t in unpack_bucket(b, f)}
        pool.retire(flats)  # reused once the rollout loop dropped its views
        return tensors

    def _merge(self, delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The held version with the delta's tensors replaced. Handed-out tensors are never
        written; when old buckets kept alive by a few unchanged views hold more than twice the
        model's bytes, the result is compacted into fresh tensors."""
        merged = {**self._current, **delta}
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in merged.values()}
        model_bytes = sum(t.numel() * t.element_size() for t in merged.values())
        if sum(storages.values()) > 2 * model_bytes:
            merged = {n: t.clone() for n, t in merged.items()}
        return merged

    def _layout_problem(self, version: int, tensors: Mapping[str, torch.Tensor], full: bool) -> str:
        if version < self.version:
            return f"v{version} is older than the held v{self.version}"
        if self.expected is None:
            return ""
        unknown = [n for n in tensors if n not in self.expected]
        if unknown:
            return f"{len(unknown)} tensors the engine does not have, e.g. {unknown[:3]}"
        wrong = [n for n, t in tensors.items() if list(t.shape) != self.expected[n]]
        if wrong:
            n = wrong[0]
            got, want = list(tensors[n].shape), self.expected[n]
            return f"{len(wrong)} tensors of the wrong shape, e.g. {n}: {got} != {want}"
        missing = [n for n in self.expected if n not in tensors] if full else []
        if missing:
            return f"{len(missing)} tensors missing, e.g. {missing[:3]}"
        return ""

    def _accept(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        with self._arrived:
            self._current = tensors if self.cfg.delta else {}
            self.version = version
            self._latest = ReceivedWeights(version, list(tensors.items()))
            self._arrived.notify_all()

    def _refuse(self, epoch: int, version: int, why: str) -> None:
        self.refused_versions += 1
        log.error("weight sync: version %d refused (%s); keeping v%d", version, why, self.version)
        self._report(epoch, version, "refused", why)

    def _report(self, epoch: int, version: int, outcome: SyncOutcome, error: str = "") -> None:
        try:
            self._live_control().sync_report(
                self.service_id, self.incarnation, epoch=epoch, version=version, outcome=outcome, error=error
            )
        except (RpcTimeout, RpcError) as e:
            log.warning("weight receiver: SYNC_REPORT not acknowledged: %s", e)
