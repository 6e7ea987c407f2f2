"""Which segment files someone outside the shard may still be reading, so they are not reused.

A same-host consumer reads leased arrays straight from the shard's segment files, and a reply
sent over ZeroMQ may still be queued with views of them. Reusing such a file (overwriting a
retired segment in place) would change those bytes under the reader. The rule:

- fifo: a lease pins every segment holding its trajectories until it is ACKed, NACKed or
  expires. A consumer reads leased arrays only before it settles the lease (and before it
  expires): after that they may be overwritten. (The learner collates, i.e. copies, before
  it ACKs.)
- replay: a SAMPLE has no lease; its segments are held for `same_host_view_hold_s`.

Retired segments wait until they are neither pinned nor held, then are reused or deleted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class ViewPins:
    def __init__(self) -> None:
        self.by_lease: dict[str, tuple[int, ...]] = {}
        self.counts: Counter[int] = Counter()
        self.held_until: dict[int, float] = {}

    def pin_lease(self, lease_id: str, segments: Iterable[int]) -> None:
        segs = tuple(set(segments))
        if not segs:
            return
        self.by_lease[lease_id] = segs
        self.counts.update(segs)

    def release_lease(self, lease_id: str) -> None:
        for n in self.by_lease.pop(lease_id, ()):
            self.counts[n] -= 1
            if self.counts[n] <= 0:
                del self.counts[n]

    def hold(self, segments: Iterable[int], until: float) -> None:
        for n in segments:
            if self.held_until.get(n, 0.0) < until:
                self.held_until[n] = until

    def pinned(self, n: int, now: float) -> bool:
        if n in self.counts:
            return True
        until = self.held_until.get(n)
        if until is None:
            return False
        if until > now:
            return True
        del self.held_until[n]
        return False

    def segments(self, now: float) -> int:
        """Segments pinned or held now (a gauge)."""
        return len(set(self.counts) | {n for n, t in self.held_until.items() if t > now})
