"""Consume-once experience storage of one shard (`buffer.mode: fifo`): FIFO of whole groups
under leases. The rules (docs/architecture.md, Buffer):

- PUT stores whole groups; a traj_id seen recently is dropped (idempotent resends).
- GET leases whole groups from the front of a policy's queue, dropping (and counting) groups
  older than `min_version` (the learner's staleness bound).
- ACK deletes a lease; NACK or lease expiry returns its groups to the front, in order.
- Queued + leased trajectories (and bytes) never exceed capacity: a PUT that would is refused
  whole (ShardFull), and the producer retries later.
- A few recently ACKed lease ids are remembered, so a resent ACK (its reply was lost) is
  answered as done instead of UNKNOWN_LEASE.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict, defaultdict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from sluice.buffer.groups import Group, GroupIncomplete, PreparedPut, ShardFull
from sluice.buffer.holder import Holder
from sluice.buffer.log_records import LeaseRecord
from sluice.buffer.stores.base import ShardStore, StoreCounters

__all__ = ["FifoStore", "GroupIncomplete", "Lease", "ShardFull", "StoreCounters", "Superseded"]

SETTLED_LEASES_KEPT = 4096
RETIRED_INCARNATIONS_KEPT = 1024


class Superseded(Exception):
    """A GET from a holder's incarnation that a newer one has replaced."""


@dataclass(slots=True)
class Lease:
    lease_id: str
    groups: list[Group]
    deadline: float
    holder: Holder = field(default_factory=Holder.anonymous)
    size: int = field(init=False)  # trajectories

    def __post_init__(self) -> None:
        self.size = sum(g.size for g in self.groups)


def lease_record(lease: Lease) -> LeaseRecord:
    """What the log keeps of a lease."""
    h = lease.holder
    return LeaseRecord(lease.lease_id, [g.seq for g in lease.groups], h.name, h.incarnation)


class FifoStore(ShardStore):
    mode: ClassVar[Literal["fifo"]] = "fifo"

    def __init__(
        self,
        capacity: int,
        lease_timeout_s: float,
        *,
        capacity_bytes: int = 1 << 62,
        dedupe_window: int = 1 << 18,
        max_policies: int = 64,
    ) -> None:
        super().__init__(capacity, capacity_bytes, dedupe_window, max_policies)
        self.lease_timeout_s = lease_timeout_s
        self.queues: dict[str, deque[Group]] = defaultdict(deque)
        self.leases: dict[str, Lease] = {}
        self.settled: OrderedDict[str, int] = OrderedDict()  # acked lease id -> trajectories
        self.queued = 0
        self.queued_bytes = 0
        self.leased = 0
        self.incarnations: dict[str, str] = {}  # holder name -> its newest incarnation seen
        self.retired: OrderedDict[tuple[str, str], None] = OrderedDict()  # (name, incarnation) replaced

    # -- writes --------------------------------------------------------------------------------

    def _admit(self, prepared: PreparedPut) -> None:
        """`capacity` counts what waits for a learner (queued), not what a learner holds: a
        learner keeps the leases it trained until its next checkpoint (exactly-once), and those
        must not throttle generation. `capacity_bytes` bounds memory: every byte held counts."""
        if self.queued + prepared.accepted > self.capacity or (
            self.held_bytes + prepared.nbytes > self.capacity_bytes
        ):
            self.counters.refused_full += prepared.accepted
            raise ShardFull(
                f"{self.queued} queued + {prepared.accepted} trajectories > capacity {self.capacity} "
                f"or {self.held_bytes} + {prepared.nbytes} bytes > capacity_bytes {self.capacity_bytes}"
            )

    def _insert(self, group: Group, priority: float | None = None) -> None:
        self._account(group, +1)
        self._enqueue(group, front=False)

    def _evict(self, seqs: list[int]) -> None:
        if seqs:
            raise AssertionError("a fifo store never evicts")

    # -- reads ---------------------------------------------------------------------------------

    def get(
        self, max_trajs: int, policy_id: str, min_version: int, now: float, holder: Holder | None = None
    ) -> tuple[Lease | None, int]:
        """Lease whole groups (at least one if any is fresh). Returns (lease or None, dropped)."""
        queue = self.queues.get(policy_id)
        dropped = 0
        taken: list[Group] = []
        n = 0
        while queue:
            group = queue[0]
            if group.version < min_version:
                queue.popleft()
                self._dequeue(group)
                self._account(group, -1)
                self._drop(group)
                dropped += group.size
                continue
            if taken and n + group.size > max_trajs:
                break
            queue.popleft()
            self._dequeue(group)
            taken.append(group)
            n += group.size
            if n >= max_trajs:
                break
        if queue is not None and not queue:
            del self.queues[policy_id]
        if not taken:
            return None, dropped
        lease = Lease(uuid.uuid4().hex, taken, now + self.lease_timeout_s, holder or Holder.anonymous())
        self.leases[lease.lease_id] = lease
        self.leased += n
        self.counters.leased_trajs += n
        return lease, dropped

    def lease(self, lease_id: str) -> Lease:
        """The lease, unchanged (KeyError if not held): what an ACK would delete."""
        return self.leases[lease_id]

    def ack(self, lease_id: str) -> int:
        lease = self.leases.pop(lease_id)  # KeyError: unknown lease
        self.leased -= lease.size
        for group in lease.groups:
            self._account(group, -1)
        self.counters.acked_trajs += lease.size
        self.remember_settled(lease_id, lease.size)
        return lease.size

    def remember_settled(self, lease_id: str, count: int) -> None:
        self.settled[lease_id] = count
        while len(self.settled) > SETTLED_LEASES_KEPT:
            self.settled.popitem(last=False)

    def nack(self, lease_id: str) -> int:
        lease = self.leases.pop(lease_id)
        self._requeue(lease)
        return lease.size

    def take_over(self, holder: Holder) -> list[Lease] | None:
        """Note `holder`'s incarnation. A new one (not the last seen for its name) means the
        holder started anew: the leases its earlier incarnations hold go back to the front of
        their queues (none of them can be ACKed any more, and waiting for their timeout would
        idle the new one) and are returned. None when it is not a new incarnation. Raises
        Superseded for an incarnation that a newer one replaced (a consumer thought dead)."""
        if not holder.name:
            return None
        if (holder.name, holder.incarnation) in self.retired:
            raise Superseded(
                f"holder {holder.name!r}: incarnation {holder.incarnation!r} was replaced by a newer one"
            )
        last = self.incarnations.setdefault(holder.name, holder.incarnation)
        if last == holder.incarnation:
            return None
        self.incarnations[holder.name] = holder.incarnation
        self.retired[(holder.name, last)] = None
        while len(self.retired) > RETIRED_INCARNATIONS_KEPT:
            self.retired.popitem(last=False)
        orphans = [lease for lease in self.leases.values() if lease.holder.name == holder.name]
        for lease in sorted(orphans, key=lambda lease: lease.groups[0].seq, reverse=True):  # oldest in front
            del self.leases[lease.lease_id]
            self._requeue(lease)
            self.counters.taken_over_trajs += lease.size
        return orphans

    def expire(self, now: float) -> list[str]:
        expired = [lease for lease in self.leases.values() if lease.deadline <= now]
        for lease in expired:
            del self.leases[lease.lease_id]
            self._requeue(lease)
        return [lease.lease_id for lease in expired]

    def next_deadline(self) -> float | None:
        return min((lease.deadline for lease in self.leases.values()), default=None)

    def settled_snapshot(self) -> dict[str, int]:
        return dict(self.settled)

    def restore_settled(self, settled: Mapping[str, int]) -> None:
        for lease_id, count in settled.items():
            self.remember_settled(lease_id, count)

    def restore_leases(self, leases: Iterable[LeaseRecord], now: float) -> dict[str, list[Group]]:
        by_seq = {g.seq: g for q in self.queues.values() for g in q}
        out: dict[str, list[Group]] = {}
        for record in leases:
            groups = [by_seq.pop(seq) for seq in record.seqs if seq in by_seq]
            if not groups:
                continue
            holder = Holder(record.holder, record.incarnation)
            lease = Lease(record.lease_id, groups, now + self.lease_timeout_s, holder)
            self.leases[lease.lease_id] = lease
            self.leased += lease.size
            if holder.name:
                self.incarnations[holder.name] = holder.incarnation
            out[lease.lease_id] = groups
        held = {g.seq for groups in out.values() for g in groups}
        for policy, queue in list(self.queues.items()):
            for group in [g for g in queue if g.seq in held]:
                self._dequeue(group)
            self.queues[policy] = deque(g for g in queue if g.seq not in held)
            if not self.queues[policy]:
                del self.queues[policy]
        return out

    def lease_records(self) -> list[LeaseRecord]:
        return [lease_record(lease) for lease in self.leases.values()]

    # -- introspection -------------------------------------------------------------------------

    @property
    def unevictable_bytes(self) -> int:
        return self.held_bytes  # queued and leased alike, until ACKed

    def has_ready(self, policy_id: str) -> bool:
        return bool(self.queues.get(policy_id))

    def live_groups(self) -> list[Group]:
        groups = [g for q in self.queues.values() for g in q]
        groups += [g for lease in self.leases.values() for g in lease.groups]
        return sorted(groups, key=lambda g: g.seq)

    def backlog(self) -> dict[str, int]:
        """Per policy, trajectories queued or leased: delivered by producers, not yet ACKed.
        A learner that starts (or resumes) counts them as admitted already."""
        out: dict[str, int] = {}
        groups = [g for q in self.queues.values() for g in q]
        groups += [g for lease in self.leases.values() for g in lease.groups]
        for g in groups:
            out[f"backlog.{g.policy_id}"] = out.get(f"backlog.{g.policy_id}", 0) + g.size
        return out

    def stats(self) -> dict[str, int]:
        c = self.counters
        return (
            super().stats()
            | self.backlog()
            | {
                "queued": self.queued,
                "queued_bytes": self.queued_bytes,
                "leased": self.leased,
                "leases": len(self.leases),
                "delivered": c.leased_trajs,
                "acked": c.acked_trajs,
                "redelivered": c.redelivered_trajs,
                "taken_over": c.taken_over_trajs,
            }
        )

    # -- internals -----------------------------------------------------------------------------

    def _enqueue(self, group: Group, front: bool) -> None:
        queue = self.queues[group.policy_id]
        if front:
            queue.appendleft(group)
        else:
            queue.append(group)
        self.queued += group.size
        self.queued_bytes += group.nbytes
        self._count_version(group, +1)

    def _dequeue(self, group: Group) -> None:
        self.queued -= group.size
        self.queued_bytes -= group.nbytes
        self._count_version(group, -1)

    def _requeue(self, lease: Lease) -> None:
        self.leased -= lease.size
        for group in reversed(lease.groups):
            self._enqueue(group, front=True)
        self.counters.redelivered_trajs += lease.size
