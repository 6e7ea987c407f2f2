"""Bounded memory of the traj_ids a shard has accepted, so that resent PUTs are idempotent.

Why this shape: a producer resends a PUT only while it waits for the reply (up to its give-up
time), so only recent ids need remembering. Two generations of 64-bit id hashes (xxh64): new
ids go into `current`; when it holds `window / 2`, it becomes `previous` and the old previous
is forgotten. Lookups check both, so the newest `window / 2` ids are always remembered and
never more than `window` are held: memory is bounded (~60 bytes per id in CPython sets) and no
per-id bookkeeping happens on ACK or eviction. Each generation also keeps its hashes in
arrival order in a preallocated uint64 array, so the snapshot a log compaction takes (every few
hundred MB written) is two slices copied, not a Python loop over up to `window` ints (that loop
was ~12% of a streaming shard's main thread).

Why not a Bloom filter: a false positive would silently drop a new trajectory after telling
the producer it was a duplicate. A 64-bit hash collision inside a window of 2^20 ids has
probability ~3e-8 per id; that is the accepted risk, and it is far below a Bloom filter's.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import xxhash


def id_hash(traj_id: str) -> int:
    return xxhash.xxh64_intdigest(traj_id.encode())


class DedupeWindow:
    def __init__(self, window: int) -> None:
        if window < 2:
            raise ValueError(f"dedupe window {window} must be >= 2")
        self.generation = window // 2
        self.current: set[int] = set()
        self.previous: set[int] = set()
        self._current_order = np.empty(self.generation, dtype=np.uint64)  # `current`, in arrival order
        self._previous_order = np.empty(self.generation, dtype=np.uint64)

    def __contains__(self, traj_id: str) -> bool:
        return self.has_hash(id_hash(traj_id))

    def has_hash(self, h: int) -> bool:
        return h in self.current or h in self.previous

    def __len__(self) -> int:
        return len(self.current) + len(self.previous)

    def add_many(self, traj_ids: Iterable[str]) -> None:
        self.add_hashes(id_hash(t) for t in traj_ids)

    def add_hashes(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            h = int(h)
            if h in self.current:
                continue
            self._current_order[len(self.current)] = h
            self.current.add(h)
            if len(self.current) >= self.generation:
                self.previous, self.current = self.current, set()
                self._previous_order, self._current_order = self._current_order, self._previous_order

    def snapshot(self) -> np.ndarray:
        """Every remembered hash, oldest first (what the log's snapshot stores)."""
        return np.concatenate(
            [self._previous_order[: len(self.previous)], self._current_order[: len(self.current)]]
        )
