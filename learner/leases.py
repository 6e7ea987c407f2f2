"""Exactly-once consumption across learner crashes: which leases are trained but not ACKed.

The rule: a lease is ACKed only once a checkpoint that contains the effect of training on it
is on disk (with checkpoints off, right after the step: they ride on the first GET of the batch
after next, learner/source.py, the step's ids held as `in_flight` until that batch brings
the outcome back, or `pending` again when a shard of theirs was down). So:
- crash before that checkpoint: the leases are not ACKed, they expire at the shard and are
  redelivered; the learner resumes from a state that never saw them and trains on them once.
- crash after the checkpoint, before or during the ACKs: the checkpoint lists those leases
  (`pending`); on resume they are ACKed. If a lease is gone by then (expired and requeued, or
  the shard restarted), every trajectory id of it goes to `skip_ids`: when it comes back it is
  ACKed with its lease but never trained on again.
So no leased sample is lost and none is trained twice by the surviving lineage. The same skip
applies while running when an ACK finds its lease expired (a step slower than the lease), and
to an id that comes back while the step that consumed it waits for its checkpoint (a shard that
restarted requeued it: its ACK has not yet found the lease gone).
Leases that were only prefetched (not trained) at a crash simply expire and are redelivered.
A step leased on a shard that is down stays pending (`split_reachable`): its ACK waits for the
shard to be back, and every checkpoint lists it meanwhile (docs/architecture.md, "Checkpoints and
exactly-once").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sluice.buffer.client import BufferClient, BufferError, LeasedBatch
from sluice.trajectory import Trajectory

log = logging.getLogger(__name__)


@dataclass
class StepLeases:
    """What one learner step consumed."""

    leases: list[tuple[int, str]]  # (shard, lease_id)
    traj_ids: list[str]  # every trajectory in those leases (trained, skipped or too stale)
    skipped: list[str]  # ids in the leases that were in skip_ids (not trained)
    leased_at: float  # monotonic time of the first GET


@dataclass
class LeaseLedger:
    pending: list[StepLeases] = field(default_factory=list)
    skip_ids: set[str] = field(default_factory=set)
    # steps whose ACKs are on their way (on a prefetched GET, `detach`), not yet `apply`d
    in_flight: list[StepLeases] = field(default_factory=list)

    def filter(self, trajs: Sequence[Trajectory]) -> tuple[list[Trajectory], list[str]]:
        """(trajectories to train on, ids skipped because they were trained already: in
        `skip_ids`, or consumed by a step whose leases wait for a checkpoint; a restarted shard
        requeues those before their ACK tells this learner they are gone)."""
        held = self.skip_ids | self.pending_ids()
        keep = [t for t in trajs if t.traj_id not in held]
        return keep, [t.traj_id for t in trajs if t.traj_id in held]

    def pending_ids(self) -> set[str]:
        """Every trajectory id of the steps not yet ACKed (or whose ACKs are on their way)."""
        return {i for step in (*self.pending, *self.in_flight) for i in step.traj_ids}

    def add(self, leased: LeasedBatch, skipped: list[str], leased_at: float) -> None:
        self.pending.append(
            StepLeases(list(leased.leases), [t.traj_id for t in leased.trajs], skipped, leased_at)
        )

    def oldest_age(self, now: float | None = None, reachable: Callable[[int], bool] | None = None) -> float:
        """How long ago the oldest pending step leased its batch. With `reachable` (a shard's
        index: whether it is up), only steps whose shards are all up count: one on a shard
        that is down cannot be ACKed however old it is, so a checkpoint for it would do nothing."""
        up = {k: reachable(k) for k in self.pending_shards()} if reachable is not None else {}
        ages = [s.leased_at for s in self.pending if all(up.get(k, True) for k, _ in s.leases)]
        return (now if now is not None else time.monotonic()) - min(ages) if ages else 0.0

    def pending_shards(self) -> set[int]:
        """The shards that hold the pending steps' leases."""
        return {k for step in self.pending for k, _ in step.leases}

    def settle(self, client: BufferClient) -> tuple[int, list[str]]:
        """ACK every pending lease whose shard is up (`split_reachable`). A step with a lease
        on a shard that is down stays pending: its ACK would be retried until the shard came
        back (the client's `timeout_s`), and for a shard down for good it never would. The
        checkpoint that holds the step lists it, so a resume ACKs it. Returns (trajectories
        ACKed, ids newly added to skip_ids)."""
        steps, self.pending = split_reachable(client, self.pending)
        self.in_flight.extend(steps)
        try:
            acks = ack_steps(client, steps)
        except BaseException:
            self.undo(steps)
            raise
        return self.apply(steps, acks)

    def detach(self) -> list[StepLeases]:
        """The pending steps, now in flight: their ids stay held until `apply`."""
        steps, self.pending = self.pending, []
        self.in_flight.extend(steps)
        return steps

    def undo(self, steps: list[StepLeases]) -> None:
        """`steps` (detached) are pending again: their ACKs did not get through."""
        self._land(steps)
        self.pending[:0] = steps

    def _land(self, steps: list[StepLeases]) -> None:
        """`steps` are no longer in flight."""
        self.in_flight = [s for s in self.in_flight if all(s is not x for x in steps)]

    def apply(self, steps: list[StepLeases], acks: list[tuple[int, bool]]) -> tuple[int, list[str]]:
        """Record what `ack_steps` found for `steps` (detached before). Returns (trajectories
        ACKed, ids newly added to skip_ids)."""
        self._land(steps)
        lost: list[str] = []
        for step, (_, whole) in zip(steps, acks, strict=True):
            if whole:
                self.skip_ids.difference_update(step.skipped)
                continue
            log.warning("a trained lease was gone at ACK: its %d ids will be skipped", len(step.traj_ids))
            new = [i for i in step.traj_ids if i not in self.skip_ids]
            self.skip_ids.update(step.traj_ids)
            lost.extend(new)
        return sum(n for n, _ in acks), lost

    # -- checkpoint state ----------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "pending": [
                {"leases": [list(x) for x in s.leases], "traj_ids": s.traj_ids, "skipped": s.skipped}
                for s in (*self.in_flight, *self.pending)
            ],
            "skip_ids": sorted(self.skip_ids),
        }

    @classmethod
    def from_state(cls, state: dict) -> LeaseLedger:
        now = time.monotonic()
        pending = [
            StepLeases(
                [(int(k), str(i)) for k, i in s["leases"]], list(s["traj_ids"]), list(s["skipped"]), now
            )
            for s in state.get("pending", [])
        ]
        return cls(pending=pending, skip_ids=set(state.get("skip_ids", [])))


def split_reachable(
    client: BufferClient, steps: list[StepLeases]
) -> tuple[list[StepLeases], list[StepLeases]]:
    """(steps whose every lease's shard is up now, the others). An ACK to a shard that is down
    would be retried until it came back (the client's `timeout_s`), and a GET that carried it
    with it: a batch would wait for the restart of a shard it needs nothing from, a checkpoint
    for one that may never come back."""
    down = {k for k in {k for step in steps for k, _ in step.leases} if not client.reachable(k)}
    ride = [step for step in steps if down.isdisjoint(k for k, _ in step.leases)]
    return ride, [step for step in steps if not down.isdisjoint(k for k, _ in step.leases)]


def ack_steps(client: BufferClient, steps: Sequence[StepLeases]) -> list[tuple[int, bool]]:
    """ACK every lease of `steps`: per step, (trajectories ACKed, whether every lease was still
    there; one may be gone: expired, or its shard restarted). Touches only `client`, so it may
    run on another thread than the ledger's (the batch prefetch's)."""
    out: list[tuple[int, bool]] = []
    for step in steps:
        acked, whole = 0, True
        for lease in step.leases:
            try:
                acked += client.ack(LeasedBatch(leases=[lease]))
            except BufferError as e:
                if e.code != "UNKNOWN_LEASE":
                    raise
                whole = False
        out.append((acked, whole))
    return out
