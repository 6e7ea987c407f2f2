"""Which shard the client sends to: a group's home shard, where a new group goes while its home
is down, the pins that keep a group that may have been stored on one shard from going to
another (dedupe is per shard), the order reads visit shards in, and when a down shard is worth
trying again. The rules and why: docs/architecture.md, Buffer (Client: placement, retries).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from sluice.buffer.link import ShardLink
from sluice.rpc import RpcTimeout
from sluice.wire.codec import Frame
from sluice.wire.messages import TrajectoryMeta

# Pins kept (oldest forgotten first): enough that a caller's own retry of a failed `put` is
# still pinned where the first attempt may have gone.
PLACEMENT_MEMORY = 65536


class ShardUnavailable(RpcTimeout):
    """A shard could not be reached (or did not answer) before the client gave up."""


def shard_of(group_id: str, n_shards: int) -> int:
    """A group's home shard: the same in every process, so a resend lands where the first went."""
    return xxhash.xxh64_intdigest(group_id.encode()) % n_shards


def fallback_order(group_id: str, n_shards: int) -> list[int]:
    """Every shard, in a pseudo-random order that depends on the group (rendezvous hashing, so
    a down shard's groups spread over all the others)."""
    return sorted(range(n_shards), key=lambda k: -xxhash.xxh64_intdigest(f"{group_id}/{k}".encode()))


@dataclass
class OutGroup:
    """A group on its way to a shard."""

    group_id: str
    wire: list[tuple[TrajectoryMeta, list[Frame]]]  # each trajectory's header and array frames
    nbytes: int
    shard: int = -1  # chosen by Placement.route
    pinned: bool = False  # a PUT carrying it may have reached `shard`: never route it elsewhere
    frames_only: bool = False  # its same-host PUT was refused: send its arrays as frames

    @property
    def metas(self) -> list[TrajectoryMeta]:
        return [m for m, _ in self.wire]

    @property
    def frames(self) -> list[Frame]:
        return [f for _, frames in self.wire for f in frames]


class Placement:
    """Shard choice for one client's links (not thread-safe, like the client)."""

    def __init__(self, links: Sequence[ShardLink]) -> None:
        self.links = links
        self.pins: OrderedDict[str, int] = OrderedDict()  # group_id -> the shard it may be on
        self.rerouted_groups = 0  # new groups stored away from their home shard (it was down)
        self._next_read = 0

    @property
    def n_shards(self) -> int:
        return len(self.links)

    def route(self, todo: Sequence[OutGroup], now: float) -> dict[int, list[OutGroup]]:
        """Choose each group's shard (a pinned group keeps its own); the groups by shard."""
        by_shard: dict[int, list[OutGroup]] = {}
        for g in todo:
            if not g.pinned:
                pinned = self.pins.get(g.group_id)
                g.shard, g.pinned = (
                    (pinned, True) if pinned is not None else (self.place(g.group_id, now), False)
                )
            by_shard.setdefault(g.shard, []).append(g)
        return by_shard

    def place(self, group_id: str, now: float) -> int:
        """Shard of a new group: its home if that is up, else the first live one in its order."""
        home = shard_of(group_id, self.n_shards)
        if self.links[home].available(now):
            return home
        for k in fallback_order(group_id, self.n_shards):
            if self.links[k].available(now):
                self.rerouted_groups += 1
                return k
        return home  # nothing is up: wait for the home shard

    def pin(self, g: OutGroup) -> None:
        """`g` may be stored on its shard: every later PUT of it goes there."""
        g.pinned = True
        self.pins[g.group_id] = g.shard
        self.pins.move_to_end(g.group_id)
        while len(self.pins) > PLACEMENT_MEMORY:
            self.pins.popitem(last=False)

    def retry_delay(self, groups: Sequence[OutGroup]) -> float:
        """How long until any shard these groups may go to is worth trying again."""
        now = time.monotonic()
        if any(not g.pinned for g in groups) and any(link.available(now) for link in self.links):
            return 0.0
        shards = {g.shard for g in groups if g.pinned} or set(range(self.n_shards))
        return max(0.0, min(self.links[k].retry_at for k in shards) - now)

    def read_order(self) -> list[ShardLink]:
        """Live shards, starting one further each call (fairness)."""
        now = time.monotonic()
        start = self._next_read
        self._next_read = (self._next_read + 1) % self.n_shards
        order = [self.links[(start + i) % self.n_shards] for i in range(self.n_shards)]
        return [link for link in order if link.available(now)]

    def time_to_next_probe(self) -> float:
        """Until the first down shard is worth trying again (at least 10 ms)."""
        now = time.monotonic()
        return max(0.01, min(link.retry_at for link in self.links) - now)
