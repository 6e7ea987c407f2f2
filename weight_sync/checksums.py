"""Per-tensor xxh3-64 checksums computed piece by piece, as a bucket goes over the wire.

Both sides checksum every tensor of a bucket (`layout.slot_checksums` gives the same values
in one go). A bucket larger than a piece is sent in pieces, so a tensor can span pieces: its
hash is streamed (`xxhash.xxh3_64().update`, which gives the same digest as the one-shot
function). Pieces must be fed in order.

On the learner, hashing runs in one background thread (`ChecksumWorker`) while the main
thread casts the next piece and the collective moves the previous ones: xxhash and torch's
copy both release the GIL, so the checksums cost no time on the publish's critical path.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xxhash

from weight_sync.layout import Bucket, tensor_bytes


class SlotHasher:
    """The checksums of one bucket's tensors, fed the bucket's pieces in order."""

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self.sums: list[int] = []  # of slots done, in slot order
        self._open: xxhash.xxh3_64 | None = None  # a slot that continues into the next piece
        self._next = 0  # first element not hashed yet

    def update(self, piece: torch.Tensor, lo: int) -> None:
        """`piece`: elements `[lo, lo + piece.numel())` of the bucket, on the host."""
        if lo != self._next:
            raise ValueError(f"piece at element {lo}, expected {self._next}: pieces must come in order")
        hi = lo + piece.numel()
        slots = self.bucket.slots
        while len(self.sums) < len(slots):
            slot = slots[len(self.sums)]
            start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if start > end or (start == end and slot.numel):
                break  # the slot starts in a later piece
            data = tensor_bytes(piece[start - lo : end - lo])
            if self._open is None and start == slot.offset and end == slot.offset + slot.numel:
                self.sums.append(xxhash.xxh3_64_intdigest(data))  # whole in this piece
                continue
            if self._open is None:
                self._open = xxhash.xxh3_64()
            self._open.update(data)
            if end < slot.offset + slot.numel:
                break  # continues in the next piece
            self.sums.append(self._open.intdigest())
            self._open = None
        self._next = hi

    @property
    def done(self) -> bool:
        return len(self.sums) == len(self.bucket.slots)


class ChecksumWorker:
    """Hashes pieces in a background thread, in the order they are added. When a bucket's
    last piece is hashed, `on_bucket(i, sums)` is called in that thread (the broadcaster
    appends the sums to the store there). `finish()` waits and returns every bucket's sums;
    it raises what a hash or `on_bucket` raised."""

    def __init__(self, on_bucket: Callable[[int, list[int]], None] | None = None) -> None:
        self.on_bucket = on_bucket
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync-checksums")
        self._futures: list[Future] = []
        self._hashers: dict[int, SlotHasher] = {}
        self._sums: dict[int, list[int]] = {}

    def add(self, i: int, bucket: Bucket, piece: torch.Tensor, lo: int) -> None:
        """Piece `[lo, lo + piece.numel())` of bucket `i` (a host tensor not written any more)."""
        hasher = self._hashers.setdefault(i, SlotHasher(bucket))
        self._futures.append(self._pool.submit(self._hash, i, hasher, piece, lo))

    def _hash(self, i: int, hasher: SlotHasher, piece: torch.Tensor, lo: int) -> None:
        hasher.update(piece, lo)
        if hasher.done and i not in self._sums:
            self._sums[i] = hasher.sums
            if self.on_bucket is not None:
                self.on_bucket(i, hasher.sums)

    def finish(self) -> list[list[int]]:
        try:
            for future in self._futures:
                future.result()
        finally:
            self._pool.shutdown(wait=True)
        return [self._sums[i] for i in sorted(self._sums)]
