"""The interface every buffer store implements (`stores/__init__.py` builds one from
`buffer.mode`; docs/architecture.md, Buffer).

A store is a pure data structure (no sockets, no files, no clock of its own), so its semantics
are tested directly. Mutations that must be durable are split in two so the shard can write
its log in between: `prepare_put` validates and numbers a PUT without changing anything, the
log writes it, `commit_put` applies it. Removals that are not answers to anyone (stale drops)
are applied at once and collected for the log with `take_dropped`. What differs by mode the
server asks through hooks (leases, what refuses a reservation), never by the store's type.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from sluice.buffer.dedupe import DedupeWindow
from sluice.buffer.groups import Group, Loc, PreparedPut, PutTooLarge, assemble_groups
from sluice.buffer.log_records import LeaseRecord
from sluice.wire.codec import Frame
from sluice.wire.messages import TrajectoryMeta


@dataclass
class StoreCounters:
    put_trajs: int = 0
    duplicates: int = 0
    leased_trajs: int = 0
    acked_trajs: int = 0
    redelivered_trajs: int = 0
    taken_over_trajs: int = 0  # requeued (counted in redelivered too) when their holder restarted
    dropped_stale: int = 0
    refused_full: int = 0
    evicted_trajs: int = 0
    sampled_groups: int = 0
    priority_updates: int = 0


class ShardStore(ABC):
    mode: ClassVar[Literal["fifo", "replay"]]  # the ops it serves: GET/ACK/NACK or SAMPLE/PRIORITY

    def __init__(self, capacity: int, capacity_bytes: int, dedupe_window: int, max_policies: int) -> None:
        self.capacity = capacity
        self.capacity_bytes = capacity_bytes
        self.max_policies = max_policies
        self.dedupe = DedupeWindow(dedupe_window)
        self.counters = StoreCounters()
        self.next_seq = 0
        self.held = 0  # trajectories counted against capacity
        self.held_bytes = 0
        self.policy_trajs: Counter[str] = Counter()
        self.version_trajs: Counter[int] = Counter()  # fifo: queued; replay: stored
        self._dropped: list[int] = []

    # -- writes --------------------------------------------------------------------------------

    def prepare_put(
        self,
        metas: Sequence[TrajectoryMeta],
        frames: Sequence[Sequence[Frame]],
        locs: Sequence[Loc] | None = None,
    ) -> PreparedPut:
        """Validate a PUT and decide its effect (raises GroupIncomplete, ShardFull, PutTooLarge).
        `locs`: the frames are views of the log's files, there (a same-host PUT)."""
        prepared = assemble_groups(metas, frames, self.dedupe, self.next_seq, locs)
        new_policies = {g.policy_id for g in prepared.groups} - set(self.policy_trajs)
        if len(self.policy_trajs) + len(new_policies) > self.max_policies:
            raise PutTooLarge(
                f"policy_id {sorted(new_policies)[0]!r}: the shard already holds "
                f"{len(self.policy_trajs)} policies (buffer.max_policies={self.max_policies})"
            )
        if prepared.accepted > self.capacity or prepared.nbytes > self.capacity_bytes:
            raise PutTooLarge(
                f"trajs: {prepared.accepted} trajectories / {prepared.nbytes} bytes can never fit "
                f"capacity {self.capacity} / capacity_bytes {self.capacity_bytes}"
            )
        self._admit(prepared)
        return prepared

    def commit_put(self, prepared: PreparedPut) -> None:
        self._evict(prepared.evicted)
        for group in prepared.groups:
            self._insert(group)
        if prepared.groups:
            self.next_seq = prepared.groups[-1].seq + 1
        self.dedupe.add_hashes(prepared.new_hashes)
        self.counters.put_trajs += prepared.accepted
        self.counters.duplicates += prepared.duplicates

    def put(self, metas: Sequence[TrajectoryMeta], frames: Sequence[Sequence[Frame]]) -> tuple[int, int]:
        """prepare + commit, for callers without a log. Returns (accepted, duplicates)."""
        prepared = self.prepare_put(metas, frames)
        self.commit_put(prepared)
        return prepared.accepted, prepared.duplicates

    def restore(self, groups: Iterable[Group], priorities: dict[int, float], next_seq: int) -> None:
        """Rebuild from the log: `groups` in seq order, none of them seen by this store yet."""
        for group in groups:
            self._insert(group, priorities.get(group.seq))
            self.dedupe.add_many(t.meta.traj_id for t in group.trajs)
        self.next_seq = max(self.next_seq, next_seq)

    def take_dropped(self) -> list[int]:
        """Seqs of groups dropped since the last call (for the log)."""
        out, self._dropped = self._dropped, []
        return out

    # -- leases: a store without them (replay) has nothing to expire or remember ---------------

    def next_deadline(self) -> float | None:
        """When the next lease runs out; None while no lease is held."""
        return None

    def expire(self, now: float) -> list[str]:
        """Give back the groups of leases past their deadline. Returns those lease ids."""
        return []

    def settled_snapshot(self) -> dict[str, int]:
        """Recently ACKed lease id -> trajectories (kept by a log snapshot, so that an ACK
        resent after a lost reply is answered `replayed`)."""
        return {}

    @abstractmethod
    def restore_settled(self, settled: Mapping[str, int]) -> None:
        """Remember the ACKed lease ids recovered from the log."""

    def restore_leases(self, leases: Iterable[LeaseRecord], now: float) -> dict[str, list[Group]]:
        """Hold again the leases recovered from the log (their groups were restored queued),
        each until `now` + the lease timeout. Returns lease id -> its groups."""
        return {}

    def lease_records(self) -> list[LeaseRecord]:
        """The leases held now, as a log snapshot keeps them."""
        return []

    # -- introspection -------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return self.held

    @property
    @abstractmethod
    def unevictable_bytes(self) -> int:
        """Bytes held that no new PUT can displace: a same-host reservation must fit beside
        them (and what is reserved) within capacity_bytes."""

    @abstractmethod
    def live_groups(self) -> list[Group]:
        """Every group still held, in seq order (what a log snapshot must keep)."""

    def priorities(self) -> dict[int, float]:
        """Raw priorities by seq (replay only)."""
        return {}

    def version_counts(self) -> dict[str, int]:
        return {str(v): c for v, c in sorted(self.version_trajs.items()) if c}

    def stats(self) -> dict[str, int]:
        c = self.counters
        return {
            "capacity": self.capacity,
            "capacity_bytes": self.capacity_bytes,
            "held": self.held,
            "held_bytes": self.held_bytes,
            "policies": len(self.policy_trajs),
            "dedupe_ids": len(self.dedupe),
            "put": c.put_trajs,
            "duplicates": c.duplicates,
            "dropped_stale": c.dropped_stale,
            "refused_full": c.refused_full,
        }

    # -- for subclasses ------------------------------------------------------------------------

    @abstractmethod
    def _admit(self, prepared: PreparedPut) -> None:
        """Refuse (ShardFull) or plan evictions (prepared.evicted) for a PUT."""

    @abstractmethod
    def _insert(self, group: Group, priority: float | None = None) -> None: ...

    @abstractmethod
    def _evict(self, seqs: list[int]) -> None: ...

    def _account(self, group: Group, sign: int) -> None:
        self.held += sign * group.size
        self.held_bytes += sign * group.nbytes
        self.policy_trajs[group.policy_id] += sign * group.size
        if self.policy_trajs[group.policy_id] <= 0:
            del self.policy_trajs[group.policy_id]

    def _count_version(self, group: Group, sign: int) -> None:
        self.version_trajs[group.version] += sign * group.size
        if self.version_trajs[group.version] <= 0:
            del self.version_trajs[group.version]

    def _drop(self, group: Group) -> None:
        """Bookkeeping of a stale group removed from wherever the subclass kept it."""
        self.counters.dropped_stale += group.size
        self._dropped.append(group.seq)
