"""Replay storage of one shard (`buffer.mode: replay`): a bounded ring of whole groups,
sampled with replacement. The rules (docs/architecture.md, Buffer):

- The ring holds at most `capacity` trajectories (and `capacity_bytes`); a PUT that does not
  fit evicts the oldest groups first (FIFO eviction), so PUT is never refused for space.
- The unit of sampling is a group (a classic-RL trajectory is a group of one). Each policy has
  a sum-tree over the ring's slots (slot = seq % capacity); a group's value in it is 1
  (uniform) or (priority + eps) ** alpha (prioritized).
- SAMPLE first drops the policy's groups older than `min_version` (counted as stale), then
  draws `n` groups independently with probability value / total, and returns each draw's
  probability and importance weight w = (count * prob) ** -beta / max(w) (PER, Schaul et al.).
- PRIORITY sets new priorities by key (= the group's seq); keys of groups no longer held are
  skipped and counted. New groups get `initial_priority`, or the largest priority seen so far.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np

from sluice.buffer.groups import Group, PreparedPut
from sluice.buffer.stores.base import ShardStore
from sluice.buffer.sumtree import SumTree
from sluice.config.buffer import ReplayConfig


@dataclass
class Draw:
    group: Group
    prob: float  # probability of drawing this group from this shard
    weight: float  # importance weight, normalised by the largest in the draw


@dataclass
class Sample:
    draws: list[Draw]
    count: int  # groups eligible (after stale ones were dropped)
    total_priority: float
    dropped_stale: int  # trajectories


def importance_weights(probs: np.ndarray, count: int, beta: float) -> np.ndarray:
    """PER's weights (count * P(i)) ** -beta, scaled so the largest is 1."""
    if probs.size == 0:
        return probs.astype(np.float64)
    w = (count * probs) ** (-beta)
    return w / w.max()


class ReplayStore(ShardStore):
    mode: ClassVar[Literal["replay"]] = "replay"

    def __init__(
        self,
        capacity: int,
        *,
        replay: ReplayConfig | None = None,
        capacity_bytes: int = 1 << 62,
        dedupe_window: int = 1 << 18,
        max_policies: int = 64,
    ) -> None:
        super().__init__(capacity, capacity_bytes, dedupe_window, max_policies)
        self.cfg = replay or ReplayConfig()
        self.ring: OrderedDict[int, Group] = OrderedDict()  # seq -> group, oldest first
        self.trees: dict[str, SumTree] = {}
        self.slot_seq = np.full(capacity, -1, dtype=np.int64)
        self.slot_version = np.zeros(capacity, dtype=np.int64)
        self.raw_priority = np.zeros(capacity, dtype=np.float64)
        self.max_priority = 1.0

    # -- writes --------------------------------------------------------------------------------

    def _admit(self, prepared: PreparedPut) -> None:
        if not prepared.groups:
            return
        last_seq = prepared.groups[-1].seq
        held, held_bytes = self.held, self.held_bytes
        for seq, group in self.ring.items():
            fits = (
                held + prepared.accepted <= self.capacity
                and held_bytes + prepared.nbytes <= self.capacity_bytes
                and seq > last_seq - self.capacity  # its slot is not reused by a new group
            )
            if fits:
                break
            prepared.evicted.append(seq)
            held -= group.size
            held_bytes -= group.nbytes

    def _insert(self, group: Group, priority: float | None = None) -> None:
        if priority is None:
            priority = self.cfg.initial_priority or self.max_priority
        slot = group.seq % self.capacity
        if self.slot_seq[slot] >= 0:  # restore with a smaller capacity than the log was written with
            self._evict([int(self.slot_seq[slot])])
        while self.held + group.size > self.capacity or self.held_bytes + group.nbytes > self.capacity_bytes:
            self._evict([next(iter(self.ring))])
        self.ring[group.seq] = group
        self._account(group, +1)
        self._count_version(group, +1)
        self.slot_seq[slot] = group.seq
        self.slot_version[slot] = group.version
        self.raw_priority[slot] = priority
        self.max_priority = max(self.max_priority, priority)
        tree = self.trees.get(group.policy_id)
        if tree is None:
            tree = self.trees[group.policy_id] = SumTree(self.capacity)
        tree.update(np.array([slot]), np.array([self._leaf(priority)]))

    def _evict(self, seqs: list[int]) -> None:
        for seq in seqs:
            group = self._remove(seq)
            self.counters.evicted_trajs += group.size

    def update_priorities(self, keys: Sequence[int], priorities: Sequence[float]) -> tuple[int, int]:
        """Returns (updated, unknown): distinct keys stored / no longer stored (a key repeated
        counts once). Raises ValueError naming a bad priority."""
        if len(keys) != len(priorities):
            raise ValueError(f"keys has {len(keys)} entries, priorities {len(priorities)}")
        for i, p in enumerate(priorities):
            if not (math.isfinite(p) and p >= 0):
                raise ValueError(f"priorities[{i}]={p!r} must be finite and >= 0")
        latest = {}  # key -> priority; the last one wins when a key repeats
        for key, p in zip(keys, priorities):
            latest[key] = float(p)
        known = {k: p for k, p in latest.items() if k in self.ring}
        by_policy: dict[str, list[tuple[int, float]]] = {}
        for key, p in known.items():
            by_policy.setdefault(self.ring[key].policy_id, []).append((key % self.capacity, p))
        for policy_id, pairs in by_policy.items():
            slots = np.array([s for s, _ in pairs], dtype=np.int64)
            raw = np.array([p for _, p in pairs], dtype=np.float64)
            self.raw_priority[slots] = raw
            self.trees[policy_id].update(slots, self._leaf(raw))
        if known:
            self.max_priority = max(self.max_priority, max(known.values()))
        self.counters.priority_updates += len(known)
        return len(known), len(latest) - len(known)  # distinct keys, both

    # -- reads ---------------------------------------------------------------------------------

    def sample(
        self, n: int, policy_id: str, min_version: int, beta: float, rng: np.random.Generator
    ) -> Sample:
        dropped = self._drop_stale(policy_id, min_version)
        tree = self.trees.get(policy_id)
        if tree is None or tree.total <= 0:
            return Sample([], 0, 0.0, dropped)
        count = int(np.count_nonzero(tree.leaves))
        total = tree.total
        if n == 0:
            return Sample([], count, total, dropped)
        slots = tree.sample(n, rng)
        probs = tree.leaves[slots] / total
        weights = importance_weights(probs, count, beta)
        draws = [
            Draw(self.ring[int(self.slot_seq[s])], float(p), float(w))
            for s, p, w in zip(slots, probs, weights)
        ]
        self.counters.sampled_groups += n
        return Sample(draws, count, total, dropped)

    # -- introspection -------------------------------------------------------------------------

    def live_groups(self) -> list[Group]:
        return list(self.ring.values())

    @property
    def unevictable_bytes(self) -> int:
        return 0  # a PUT evicts the oldest groups to make room

    def restore_settled(self, settled: Mapping[str, int]) -> None:
        """No leases here: ACKed lease ids (of a log written in fifo mode) answer nothing."""

    def priorities(self) -> dict[int, float]:
        return {seq: float(self.raw_priority[seq % self.capacity]) for seq in self.ring}

    def stats(self) -> dict[str, int]:
        c = self.counters
        return super().stats() | {
            "stored": self.held,
            "stored_groups": len(self.ring),
            "evicted": c.evicted_trajs,
            "sampled": c.sampled_groups,
            "priority_updates": c.priority_updates,
        }

    # -- internals -----------------------------------------------------------------------------

    def _leaf(self, priority):
        if self.cfg.sampling == "uniform":
            return np.ones_like(priority, dtype=np.float64)
        return (np.asarray(priority, dtype=np.float64) + self.cfg.eps) ** self.cfg.alpha

    def _remove(self, seq: int) -> Group:
        group = self.ring.pop(seq)
        slot = seq % self.capacity
        self.slot_seq[slot] = -1
        self.trees[group.policy_id].update(np.array([slot]), np.zeros(1))
        self._account(group, -1)
        self._count_version(group, -1)
        if group.policy_id not in self.policy_trajs:
            del self.trees[group.policy_id]
        return group

    def _drop_stale(self, policy_id: str, min_version: int) -> int:
        tree = self.trees.get(policy_id)
        if tree is None or min_version <= 0:
            return 0
        stale = np.nonzero((tree.leaves > 0) & (self.slot_version < min_version))[0]
        dropped = 0
        for slot in stale:
            group = self._remove(int(self.slot_seq[slot]))
            self._drop(group)
            dropped += group.size
        return dropped
