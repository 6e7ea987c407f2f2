"""Consume-once experience storage of one shard: FIFO of whole groups under leases.

Pure data structure (no sockets, no clock of its own) so its semantics are tested directly:
- PUT stores whole groups; a traj_id seen before is dropped (idempotent resends).
- GET leases whole groups from the front of a policy's queue, dropping (and counting) groups
  older than `min_version` (the learner's staleness bound).
- ACK deletes a lease; NACK or lease expiry returns its groups to the front, in order.
- Queued + leased trajectories never exceed `capacity`: a PUT that would is refused whole.
"""

from __future__ import annotations

import uuid
from collections import Counter, defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from sluice.wire.codec import Frame, frame_bytes
from sluice.wire.messages import TrajectoryMeta


class ShardFull(Exception):
    """The PUT would exceed capacity."""


class GroupIncomplete(ValueError):
    """A PUT carried part of a group (groups travel whole)."""


@dataclass
class StoredTrajectory:
    meta: TrajectoryMeta
    frames: list[Frame]
    nbytes: int


@dataclass
class Group:
    group_id: str
    policy_id: str
    version: int  # oldest version of any trajectory in the group
    trajs: list[StoredTrajectory]

    @property
    def size(self) -> int:
        return len(self.trajs)


@dataclass
class Lease:
    lease_id: str
    groups: list[Group]
    deadline: float

    @property
    def size(self) -> int:
        return sum(g.size for g in self.groups)


@dataclass
class StoreCounters:
    put_trajs: int = 0
    duplicates: int = 0
    leased_trajs: int = 0
    acked_trajs: int = 0
    redelivered_trajs: int = 0
    dropped_stale: int = 0
    refused_full: int = 0


@dataclass
class FifoStore:
    capacity: int
    lease_timeout_s: float
    queues: dict[str, deque[Group]] = field(default_factory=lambda: defaultdict(deque))
    leases: dict[str, Lease] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)
    counters: StoreCounters = field(default_factory=StoreCounters)
    queued: int = 0
    queued_bytes: int = 0

    # -- writes --------------------------------------------------------------------------------

    def put(self, metas: Sequence[TrajectoryMeta], frames: Sequence[list[Frame]]) -> tuple[int, int]:
        """Store trajectories; returns (accepted, duplicates). Raises ShardFull, GroupIncomplete."""
        groups: dict[tuple[str, str], list[StoredTrajectory]] = {}
        duplicates = 0
        batch_ids: set[str] = set()
        for meta, fr in zip(metas, frames):
            if meta.traj_id in self.seen or meta.traj_id in batch_ids:
                duplicates += 1
                continue
            batch_ids.add(meta.traj_id)
            nbytes = sum(len(frame_bytes(f)) for f in fr)
            groups.setdefault((meta.policy_id, meta.group_id), []).append(
                StoredTrajectory(meta=meta, frames=list(fr), nbytes=nbytes)
            )
        for (_, group_id), trajs in groups.items():
            want = trajs[0].meta.group_size
            if any(t.meta.group_size != want for t in trajs):
                raise GroupIncomplete(f"group {group_id!r}: trajectories disagree on group_size")
            if len(trajs) != want:
                raise GroupIncomplete(
                    f"group {group_id!r}: group_size={want} but the message carries "
                    f"{len(trajs)} new trajectories of it (groups must be PUT whole)"
                )
        accepted = sum(len(t) for t in groups.values())
        if self.size + accepted > self.capacity:
            self.counters.refused_full += accepted
            raise ShardFull(f"{self.size} + {accepted} trajectories > capacity {self.capacity}")
        for (policy_id, group_id), trajs in groups.items():
            version = min(t.meta.version for t in trajs)
            self.queues[policy_id].append(Group(group_id, policy_id, version, trajs))
            self.queued += len(trajs)
            self.queued_bytes += sum(t.nbytes for t in trajs)
        self.seen |= batch_ids
        self.counters.put_trajs += accepted
        self.counters.duplicates += duplicates
        return accepted, duplicates

    # -- reads ---------------------------------------------------------------------------------

    def get(self, max_trajs: int, policy_id: str, min_version: int, now: float) -> tuple[Lease | None, int]:
        """Lease whole groups (at least one if any is fresh). Returns (lease or None, dropped)."""
        queue = self.queues.get(policy_id)
        dropped = 0
        taken: list[Group] = []
        n = 0
        while queue:
            group = queue[0]
            if group.version < min_version:
                queue.popleft()
                self._forget(group)
                dropped += group.size
                continue
            if taken and n + group.size > max_trajs:
                break
            queue.popleft()
            self.queued -= group.size
            self.queued_bytes -= sum(t.nbytes for t in group.trajs)
            taken.append(group)
            n += group.size
            if n >= max_trajs:
                break
        self.counters.dropped_stale += dropped
        if not taken:
            return None, dropped
        lease = Lease(uuid.uuid4().hex, taken, now + self.lease_timeout_s)
        self.leases[lease.lease_id] = lease
        self.counters.leased_trajs += n
        return lease, dropped

    def ack(self, lease_id: str) -> int:
        lease = self.leases.pop(lease_id)  # KeyError: unknown lease
        self.counters.acked_trajs += lease.size
        return lease.size

    def nack(self, lease_id: str) -> int:
        lease = self.leases.pop(lease_id)
        self._requeue(lease)
        return lease.size

    def expire_leases(self, now: float) -> int:
        expired = [lease for lease in self.leases.values() if lease.deadline <= now]
        for lease in expired:
            del self.leases[lease.lease_id]
            self._requeue(lease)
        return sum(lease.size for lease in expired)

    def next_deadline(self) -> float | None:
        return min((lease.deadline for lease in self.leases.values()), default=None)

    # -- introspection -------------------------------------------------------------------------

    @property
    def leased(self) -> int:
        return sum(lease.size for lease in self.leases.values())

    @property
    def size(self) -> int:
        return self.queued + self.leased

    def has_ready(self, policy_id: str) -> bool:
        return bool(self.queues.get(policy_id))

    def version_counts(self) -> dict[str, int]:
        counts: Counter[int] = Counter()
        for queue in self.queues.values():
            for group in queue:
                counts[group.version] += group.size
        return {str(v): c for v, c in sorted(counts.items())}

    def stats(self) -> dict[str, int]:
        c = self.counters
        return {
            "capacity": self.capacity,
            "queued": self.queued,
            "queued_bytes": self.queued_bytes,
            "leased": self.leased,
            "leases": len(self.leases),
            "put": c.put_trajs,
            "duplicates": c.duplicates,
            "delivered": c.leased_trajs,
            "acked": c.acked_trajs,
            "redelivered": c.redelivered_trajs,
            "dropped_stale": c.dropped_stale,
            "refused_full": c.refused_full,
        }

    # -- internals -----------------------------------------------------------------------------

    def _requeue(self, lease: Lease) -> None:
        for group in reversed(lease.groups):
            self.queues[group.policy_id].appendleft(group)
            self.queued += group.size
            self.queued_bytes += sum(t.nbytes for t in group.trajs)
        self.counters.redelivered_trajs += lease.size

    def _forget(self, group: Group) -> None:
        self.queued -= group.size
        self.queued_bytes -= sum(t.nbytes for t in group.trajs)
