"""A sum-tree over a fixed number of slots: O(log n) priority updates and proportional draws.

Array layout: node 1 is the root, node i has children 2i and 2i+1, leaves start at `base`
(the capacity rounded up to a power of two). Updates recompute every touched parent from its
children (no running deltas, so no floating-point drift), and both updates and draws work on
whole batches with numpy: one vector operation per tree level.

Hand-written rather than taken from a library: the RL libraries that have one (tianshou,
cpprb, torchrl) are large dependencies for ~60 lines, and none of them batch both operations
the way a shard needs (a PRIORITY message carries a batch of keys, a SAMPLE draws a batch).
"""

from __future__ import annotations

import numpy as np


class SumTree:
    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"sum-tree size {size} must be >= 1")
        self.size = size
        self.base = 1 << max(0, (size - 1).bit_length())
        self.depth = self.base.bit_length() - 1
        self.tree = np.zeros(2 * self.base, dtype=np.float64)

    @property
    def total(self) -> float:
        return float(self.tree[1])

    @property
    def leaves(self) -> np.ndarray:
        """A read-only view of the slot values."""
        view = self.tree[self.base : self.base + self.size]
        view.flags.writeable = False
        return view

    def update(self, slots: np.ndarray, values: np.ndarray) -> None:
        """Set `values` (>= 0) at `slots` (distinct) and fix the sums above them."""
        slots = np.asarray(slots, dtype=np.int64)
        if slots.size == 0:
            return
        values = np.asarray(values, dtype=np.float64)
        if np.any(values < 0) or not np.all(np.isfinite(values)):
            raise ValueError("sum-tree values must be finite and >= 0")
        if slots.min() < 0 or slots.max() >= self.size:
            raise IndexError(f"sum-tree slot out of range [0, {self.size})")
        pos = slots + self.base
        self.tree[pos] = values
        for _ in range(self.depth):
            pos = np.unique(pos >> 1)
            self.tree[pos] = self.tree[2 * pos] + self.tree[2 * pos + 1]

    def find(self, mass: np.ndarray) -> np.ndarray:
        """For each value in [0, total), the slot whose prefix-sum interval contains it."""
        mass = np.array(mass, dtype=np.float64)
        idx = np.ones(mass.shape, dtype=np.int64)
        for _ in range(self.depth):
            left = self.tree[2 * idx]
            go_right = mass >= left
            mass = np.where(go_right, mass - left, mass)
            idx = 2 * idx + go_right
        return idx - self.base

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """`n` slots drawn independently with probability value / total (with replacement)."""
        total = self.total
        if total <= 0:
            raise ValueError("cannot sample from an empty sum-tree")
        slots = self.find(rng.random(n) * total)
        # Rounding can land a draw on a zero-valued slot at an interval edge: draw those again.
        for _ in range(64):
            bad = self.tree[slots + self.base] <= 0
            if not bad.any():
                return slots
            slots[bad] = self.find(rng.random(int(bad.sum())) * total)
        raise RuntimeError("sum-tree draws keep landing on empty slots: tree is inconsistent")
