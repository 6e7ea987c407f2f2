"""Where a compaction cuts the log: which old segments it retires, and so which live groups it
must copy into its snapshot (those lying before the cut). Groups from the cut on stay where
they are, so a queue that is consumed in order (fifo) retires its consumed prefix without
copying a byte; a log whose old segments still hold a few live groups copies only those.
docs/architecture.md (Buffer: compaction) says why, and how recovery reads such a log.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sluice.buffer.groups import Group


def group_segment(group: Group) -> int | None:
    """The oldest segment holding any of the group's arrays (None: one is only in memory)."""
    segments = [t.loc[0] for t in group.trajs if t.loc is not None]
    if len(segments) < len(group.trajs):
        return None
    return min(segments, default=None)


def live_bytes_by_segment(groups: Iterable[Group]) -> dict[int, int]:
    """Payload bytes of live groups per segment (groups only in memory are left out)."""
    out: dict[int, int] = {}
    for group in groups:
        n = group_segment(group)
        if n is not None:
            out[n] = out.get(n, 0) + group.nbytes
    return out


def choose_cut(segments: Sequence[int], sizes: dict[int, int], live: dict[int, int], target: float) -> int:
    """How many of the oldest `segments` (in order, all closed) to retire so that what the log
    keeps (the rest, plus the live bytes copied out of the retired ones) is at most `target`
    bytes, copying as little as possible: the fewest that reach the target, then every dead
    segment right after them too (retiring those copies nothing). All of them if the target
    cannot be reached otherwise (a full compaction)."""
    kept = sum(sizes[n] for n in segments)
    cut = 0
    while cut < len(segments) and kept > target:
        n = segments[cut]
        kept -= sizes[n] - live.get(n, 0)
        cut += 1
    while cut < len(segments) and live.get(segments[cut], 0) == 0:
        cut += 1
    return cut
