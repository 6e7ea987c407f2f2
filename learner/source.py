"""Rank 0's batch source: leases the next batch from the buffer while the current step trains.

Rules:
- `request(version, settle)` asks for the batch the learner will consume at `version`: whole
  groups until `batch_size` trajectories not newer than `version`, each GET with min_version =
  version - max_staleness (the shard drops older groups). Only one batch is ever in flight:
  the next one.
- `settle`: trained steps whose leases are ACKed on the batch's first GET (one round trip for
  both; learner/leases.py says when a step may be ACKed). What the ACKs found comes back with
  the batch (`FetchedBatch.settled`, `ack_outcomes`) for the ledger. A lease gone by then fails
  that GET as a whole (UNKNOWN_LEASE): the steps are then ACKed lease by lease (ACK is
  idempotent) to learn which step lost one, and the GET goes again. A step with a lease on a
  shard that is down rides on nothing (`FetchedBatch.deferred`: the ledger keeps it pending
  for the next request), and an ACK whose shard the GET finds down is sent once, not retried
  (the GET fails; the steps on live shards are ACKed lease by lease, the others deferred): a
  batch from the live shards never waits for a dead one's restart.
- Trajectories newer than `version` (a lost lineage: made, before a crash, by weights the
  resumed learner never made) are leased with the batch but not counted toward it: the batch is
  topped up past them. Their admission quota goes back as each GET brings them (`on_dropped`,
  as for the shards' stale drops), and is charged again (`on_returned`) when a batch holding
  them is given back, since their next GET releases it once more.
- With `prefetch`, a thread does the GETs with its own BufferClient (clients are not thread
  safe); without, `take()` does them in the caller's thread. Same code either way.
- `take()` blocks until the requested batch is complete and returns it, or returns None when
  the learner is stopping (a partial batch is NACKed, nothing is kept).
- An error in the thread is re-raised by `take()`: a dead prefetcher stops the learner.
- A partial batch is never held near its lease timeout: when its first lease is older than
  half of `lease_timeout_s`, it is NACKed (back to the front of the queue) and the batch starts
  over with fresh leases. Otherwise a slow trickle of data would let the first leases expire
  and come back into the same batch (trained twice, ACK refused). A batch that gets back one of
  its own trajectories anyway (its shard restarted and queued its leases again) starts over the
  same way from the part that brought it.
- `close()` NACKs a batch that was fetched but never taken.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from sluice.buffer.client import BufferClient, BufferError, LeasedBatch
from sluice.buffer.holder import Holder
from sluice.buffer.placement import ShardUnavailable
from sluice.config.learner import LearnerConfig
from sluice.learner.leases import StepLeases, ack_steps, split_reachable
from sluice.trajectory import Trajectory


@dataclass
class FetchedBatch:
    version: int  # the learner version that consumes it
    min_version: int
    leased: LeasedBatch
    leased_at: float  # monotonic time of the first GET
    fetch_s: float  # time spent completing it (GETs and long polls)
    gets: int = 0  # BufferClient.get calls it took
    settled: list[StepLeases] = field(default_factory=list)  # steps ACKed on its first GET ...
    ack_outcomes: list[tuple[int, bool]] = field(default_factory=list)  # ... as `ack_steps` says
    deferred: list[StepLeases] = field(default_factory=list)  # steps to settle: a shard was down

    @property
    def lost_lineage(self) -> int:
        """Trajectories leased beyond the batch: newer than the version that consumes it."""
        return newer_than(self.leased.trajs, self.version)

    def current(self) -> list[Trajectory]:
        """The batch itself: trajectories not newer than the version that consumes it (the
        complement of `lost_lineage`)."""
        return [t for t in self.leased.trajs if t.version <= self.version]


def newer_than(trajs: list[Trajectory], version: int) -> int:
    """How many of `trajs` were made by weights newer than `version`."""
    return sum(t.version > version for t in trajs)


@dataclass
class _Assembly:
    """The batch being leased: what it holds, since when, and how much of it counts."""

    leased: LeasedBatch = field(default_factory=LeasedBatch)
    leased_at: float = field(default_factory=time.monotonic)  # reset at its first lease
    usable: int = 0  # trajectories not newer than the version: what counts toward the batch
    newer: int = 0  # the others: a lost lineage's, their quota released


def give_back(client: BufferClient, leased: LeasedBatch) -> None:
    """NACK a batch not trained on. A lease already gone (its shard restarted, or it expired)
    needs nothing: its groups are queued again anyway."""
    if not leased.leases:
        return
    try:
        client.nack(leased)
    except BufferError as e:
        if e.code != "UNKNOWN_LEASE":
            raise


class BatchSource:
    def __init__(
        self,
        endpoints: list[str],
        policy_id: str,
        lc: LearnerConfig,
        stop: threading.Event,
        lease_timeout_s: float,
        on_dropped: Callable[[int], None] = lambda n: None,
        on_returned: Callable[[int], None] = lambda n: None,
        ctx: zmq.Context | None = None,
        holder: Holder | None = None,
    ) -> None:
        self.endpoints = endpoints
        self.holder = holder  # named on every GET: a restarted learner takes over its leases
        # told, per GET, of samples that will not be trained: dropped as stale by the shards,
        # or of a lost lineage (leased beyond the batch) ...
        self.on_dropped = on_dropped
        # ... and of those of a lost lineage given back with a partial batch (leased again later)
        self.on_returned = on_returned
        self.ctx = ctx
        self.lease_timeout_s = lease_timeout_s
        self.restarts = 0  # partial batches given back because their leases grew old
        self.policy_id = policy_id
        self.lc = lc
        self.stop = stop
        self._cond = threading.Condition()
        self._wanted: tuple[int, list[StepLeases]] | None = None  # (version, steps to ACK)
        self._ready: FetchedBatch | None = None
        self._error: BaseException | None = None
        self._closing = False
        self._thread: threading.Thread | None = None
        self._client: BufferClient | None = None
        if lc.prefetch:
            self._thread = threading.Thread(target=self._run, name="batch-prefetch", daemon=True)
            self._thread.start()
        else:
            self._client = BufferClient(endpoints, ctx=ctx, holder=holder, should_abort=stop.is_set)

    def request(self, version: int, settle: list[StepLeases] | None = None) -> None:
        with self._cond:
            assert self._wanted is None and self._ready is None, "one batch in flight at a time"
            self._wanted = (version, list(settle or []))
            self._cond.notify_all()

    def take(self) -> FetchedBatch | None:
        if self._thread is None:
            wanted, self._wanted = self._wanted, None
            assert wanted is not None and self._client is not None, "request() first"
            return self._fetch(self._client, *wanted)
        with self._cond:
            while self._ready is None and self._error is None:
                if self.stop.is_set():
                    return None
                self._cond.wait(timeout=0.1)
            if self._error is not None:
                raise RuntimeError("batch prefetch thread failed") from self._error
            ready, self._ready = self._ready, None
            return ready

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._client is not None:
            self._client.close()

    # -- fetching ------------------------------------------------------------------------------

    def _stopping(self) -> bool:
        return self.stop.is_set() or self._closing

    def _fetch(self, client: BufferClient, version: int, settle: list[StepLeases]) -> FetchedBatch | None:
        lc = self.lc
        min_version = version - lc.max_staleness
        batch = _Assembly()
        t0 = time.perf_counter()
        gets, outcomes = 0, None  # outcomes: what the ACKs of `settle` found, once sent
        ride, deferred = split_reachable(client, settle)
        settled: list[StepLeases] = []
        while batch.usable < lc.batch_size:
            if self._stopping():
                self._give_back(client, batch.leased, batch.newer)
                return None
            if batch.leased.leases and time.monotonic() - batch.leased_at > self.lease_timeout_s / 2:
                batch = self._start_over(client, batch)  # too old to keep waiting on
            want = lc.batch_size - batch.usable
            if ride and outcomes is None:
                part, settled, outcomes, late = self._get_settling(client, want, min_version, ride)
                deferred += late
            else:
                part = client.get(
                    want, min_version=min_version, policy_id=self.policy_id, wait_ms=lc.get_wait_ms
                )
            gets += 1
            if part is None:
                continue
            held = {t.traj_id for t in batch.leased.trajs}
            if any(t.traj_id in held for t in part.trajs):
                # A lease of this batch is gone (its shard restarted, or it expired) and its
                # groups came back: give the rest back and start over from this part.
                batch = self._start_over(client, batch)
            self._add(batch, part, version)
        return FetchedBatch(
            version, min_version, batch.leased, batch.leased_at, time.perf_counter() - t0, gets,
            settled, outcomes or [], deferred,  # (no outcomes: nothing rode)
        )  # fmt: skip

    def _get_settling(
        self, client: BufferClient, want: int, min_version: int, settle: list[StepLeases]
    ) -> tuple[LeasedBatch | None, list[StepLeases], list[tuple[int, bool]], list[StepLeases]]:
        """The batch's first GET, ACKing `settle`'s leases first: (what it leased, the steps
        settled, `ack_steps`'s outcome for each, the steps deferred). A lease gone fails the
        whole GET (after the others are ACKed and what it leased is given back), and so does a
        shard found down on the way (sent once, not retried); then the steps whose shards are
        up are ACKed again lease by lease (ACK is idempotent) to tell which step lost one, the
        others are deferred, and nothing is leased (None)."""
        leases = LeasedBatch(leases=[lease for step in settle for lease in step.leases])
        try:
            part = client.get(
                want,
                min_version=min_version,
                policy_id=self.policy_id,
                wait_ms=self.lc.get_wait_ms,
                ack=leases,
                ack_patience_s=0.0,
            )
        except (BufferError, ShardUnavailable) as e:
            if isinstance(e, BufferError) and e.code != "UNKNOWN_LEASE":
                raise
            ride, deferred = split_reachable(client, settle)  # (a shard may have died since)
            return None, ride, ack_steps(client, ride), deferred
        # every lease was there, so each step's ACK deleted every trajectory it leased
        return part, settle, [(len(step.traj_ids), True) for step in settle], []

    def _add(self, batch: _Assembly, part: LeasedBatch, version: int) -> None:
        """Add a GET's part to the batch; release the quota of what it will not train."""
        newer = newer_than(part.trajs, version)
        if part.dropped_stale + newer:
            self.on_dropped(part.dropped_stale + newer)
        if not batch.leased.leases and part.leases:
            batch.leased_at = time.monotonic()
        batch.leased.extend(part)
        batch.usable += len(part.trajs) - newer
        batch.newer += newer

    def _give_back(self, client: BufferClient, leased: LeasedBatch, newer: int) -> None:
        """NACK a batch not trained on; its lost lineage's quota is charged again (queued
        again, those trajectories release it once more when a GET brings them back)."""
        give_back(client, leased)
        if newer:
            self.on_returned(newer)

    def _start_over(self, client: BufferClient, batch: _Assembly) -> _Assembly:
        """Give a partial batch back; the new one keeps its count of stale drops (the step
        reports every drop its GETs saw: the shard's count and the learner's agree)."""
        self._give_back(client, batch.leased, batch.newer)
        self.restarts += 1
        return _Assembly(LeasedBatch(dropped_stale=batch.leased.dropped_stale))

    def _run(self) -> None:
        client = BufferClient(self.endpoints, ctx=self.ctx, holder=self.holder, should_abort=self.stop.is_set)
        try:
            while True:
                with self._cond:
                    while self._wanted is None and not self._closing:
                        self._cond.wait(timeout=0.5)
                    if self._closing:
                        break
                    wanted, self._wanted = self._wanted, None
                if wanted is None:  # the wait above ends only on a request or on closing
                    raise RuntimeError("batch prefetch woke with no batch requested")
                fetched = self._fetch(client, *wanted)
                with self._cond:
                    if fetched is not None and self._closing:
                        self._give_back(client, fetched.leased, fetched.lost_lineage)
                        break
                    self._ready = fetched
                    self._cond.notify_all()
            with self._cond:
                if self._ready is not None:  # fetched, never taken: give it back
                    self._give_back(client, self._ready.leased, self._ready.lost_lineage)
                    self._ready = None
        except BaseException as e:  # noqa: BLE001 - re-raised by take() in the learner thread
            with self._cond:
                self._error = e
                self._cond.notify_all()
        finally:
            client.close()
