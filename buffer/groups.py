"""What a shard stores: whole groups of trajectories, each with a shard-local sequence number.

The payload frames are the ones received from ZeroMQ (or read back from the log), or views of
the shard's own segment files where a same-host producer wrote them: a stored trajectory never
copies its arrays, and a GET reply sends the same frames back out. Where the shard's log holds a
trajectory's bytes, `loc` says where (what same-host consumers are given instead of frames).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from sluice.buffer.dedupe import DedupeWindow, id_hash
from sluice.wire.codec import Frame
from sluice.wire.messages import TrajectoryMeta


class GroupIncomplete(ValueError):
    """A PUT carried part of a group (groups travel whole)."""


class ShardFull(Exception):
    """The PUT would exceed the shard's capacity (fifo); the producer should retry later."""


class PutTooLarge(ValueError):
    """The PUT can never fit in this shard, whatever is consumed first."""


Loc = tuple[int, int]  # (segment number, file offset of the first array); arrays back to back


@dataclass(slots=True)
class StoredTrajectory:
    meta: TrajectoryMeta
    frames: list[Frame]
    nbytes: int
    loc: Loc | None = None  # where the log holds its arrays (None: only in `frames`)
    mapped: bool = False  # `frames` are views of the log's files (re-made when the log moves them)

    def logged_at(self) -> Loc:
        """`loc`, for a trajectory the log holds (one only in memory has no place there)."""
        if self.loc is None:
            raise ValueError(f"trajectory {self.meta.traj_id!r} is not in the log")
        return self.loc


@dataclass(slots=True)
class Group:
    seq: int  # shard-local, increasing in PUT order; the log's and PRIORITY's key of the group
    group_id: str
    policy_id: str
    version: int  # oldest version of any trajectory in the group
    trajs: list[StoredTrajectory]  # (never changes once the group is made)
    nbytes: int = field(init=False)
    size: int = field(init=False)  # trajectories

    def __post_init__(self) -> None:
        self.nbytes = sum(t.nbytes for t in self.trajs)
        self.size = len(self.trajs)

    @property
    def metas(self) -> list[TrajectoryMeta]:
        return [t.meta for t in self.trajs]

    @property
    def frames(self) -> list[Frame]:
        return [f for t in self.trajs for f in t.frames]


@dataclass
class PreparedPut:
    """A validated PUT, not yet applied: the log writes it, then the store commits it."""

    groups: list[Group]
    duplicates: int
    evicted: list[int] = field(default_factory=list)  # replay: seqs the commit will evict
    new_hashes: list[int] = field(default_factory=list)  # dedupe hashes of the stored traj_ids

    @cached_property
    def accepted(self) -> int:
        return sum(g.size for g in self.groups)

    @cached_property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)


def assemble_groups(
    metas: Sequence[TrajectoryMeta],
    frames: Sequence[Sequence[Frame]],
    dedupe: DedupeWindow,
    first_seq: int,
    locs: Sequence[Loc] | None = None,
) -> PreparedPut:
    """Drop already-seen trajectories, check that every group's new members are all present,
    and number the groups from `first_seq` in order of first appearance. Changes nothing.
    `locs` (one per trajectory): the frames are views of the log's files at these places."""
    by_group: dict[tuple[str, str], list[StoredTrajectory]] = {}
    batch_hashes: set[int] = set()
    duplicates = 0
    for i, (meta, fr) in enumerate(zip(metas, frames)):
        h = id_hash(meta.traj_id)
        if h in batch_hashes or dedupe.has_hash(h):
            duplicates += 1
            continue
        batch_hashes.add(h)
        nbytes = sum(_nbytes(f) for f in fr)
        stored = StoredTrajectory(meta=meta, frames=list(fr), nbytes=nbytes)
        if locs is not None:
            stored.loc, stored.mapped = locs[i], True
        by_group.setdefault((meta.policy_id, meta.group_id), []).append(stored)
    groups = []
    for (policy_id, group_id), trajs in by_group.items():
        want = trajs[0].meta.group_size
        if any(t.meta.group_size != want for t in trajs):
            raise GroupIncomplete(f"group {group_id!r}: trajectories disagree on group_size")
        if len(trajs) != want:
            raise GroupIncomplete(
                f"group {group_id!r}: group_size={want} but the message carries "
                f"{len(trajs)} new trajectories of it (groups must be PUT whole)"
            )
        version = min(t.meta.version for t in trajs)
        groups.append(Group(first_seq + len(groups), group_id, policy_id, version, trajs))
    return PreparedPut(groups=groups, duplicates=duplicates, new_hashes=list(batch_hashes))


def _nbytes(frame: Frame) -> int:
    """Bytes of a payload frame: a zmq.Frame or bytes (len is bytes), or a memoryview."""
    return frame.nbytes if isinstance(frame, memoryview) else len(frame)
