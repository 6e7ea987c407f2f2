"""Read-only memory maps of a shard's segment files: how same-host readers see payload bytes.

The shard uses them to view what same-host producers wrote into its segments, same-host
clients to view what GET and SAMPLE replies point at (`TrajRef`). A file is mapped whole,
shared and read-only, and mapped again, larger, when a view reaches past the current mapping
(the active segment grows). Views keep their mapping alive: dropping a mapping from the cache
only drops the cache's reference, and the kernel unmaps it when the last view is gone.

The shard never truncates a segment file (a mapped page past the end of its file would kill
the reader with SIGBUS): it writes records at explicit offsets, seals segments, renames files
to reuse them and deletes them (a deleted file stays readable through its mappings).
"""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict
from pathlib import Path


def segment_name(n: int) -> str:
    return f"{n:012d}.seg"


class SegmentGone(OSError):
    """A segment file is missing or shorter than a view of it needs."""


class SegmentMaps:
    def __init__(self, directory: Path | str, keep: int = 8) -> None:
        self.dir = Path(directory)
        self.keep = keep
        self._maps: OrderedDict[int, mmap.mmap] = OrderedDict()

    def path(self, n: int) -> Path:
        return self.dir / segment_name(n)

    def view(self, n: int, offset: int, length: int) -> memoryview:
        """Bytes [offset, offset + length) of segment `n`, without copying (read-only)."""
        if offset < 0 or length < 0:
            raise SegmentGone(f"segment {n}: bad range [{offset}, {offset + length})")
        mm = self._maps.get(n)
        if mm is None or offset + length > len(mm):
            mm = self._map(n, offset + length)
        else:
            self._maps.move_to_end(n)
        return memoryview(mm)[offset : offset + length]

    def _map(self, n: int, need: int) -> mmap.mmap:
        path = self.path(n)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise SegmentGone(f"{path}: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size < need or size == 0:
                raise SegmentGone(f"{path} holds {size} bytes, {need} needed")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._maps[n] = mm
        self._maps.move_to_end(n)
        while len(self._maps) > self.keep:
            self._maps.popitem(last=False)
        return mm

    def forget(self, n: int) -> None:
        self._maps.pop(n, None)

    def clear(self) -> None:
        self._maps.clear()
