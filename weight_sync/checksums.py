"""Checksums of what goes over the wire: per-tensor xxh3-64 of host bytes, or wsum32 per piece
on the device the piece lives on; `WireChecksum` says, for both sides, which one an
announcement's sums are.

xxh3 costs an accelerator a device-to-host copy and a CPU core; wsum32 is computed where the
bytes are, with plain torch ops, so CPU (tests) and GPU give the same value. A tensor can span
pieces, so its xxh3 is streamed (the same digest as `layout.slot_checksums` in one go): pieces
must be fed in order. On the learner, hashing runs in one background thread
(`ChecksumWorker`), off the publish's critical path (xxhash and torch's copy release the
GIL). Measurements and the rules: docs/architecture.md, "Weight sync" (Wire checksums).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import xxhash

from sluice.weight_sync.layout import Bucket, tensor_bytes


class SlotHasher:
    """The checksums of one bucket's tensors, fed the bucket's pieces in order."""

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self.sums: list[int] = []  # of slots done, in slot order
        self._open: xxhash.xxh3_64 | None = None  # a slot that continues into the next piece
        self._next = 0  # first element not hashed yet

    def update(self, piece: torch.Tensor, lo: int) -> None:
        """`piece`: elements `[lo, lo + piece.numel())` of the bucket (copied to the host first
        when it is on an accelerator)."""
        if lo != self._next:
            raise ValueError(f"piece at element {lo}, expected {self._next}: pieces must come in order")
        if piece.device.type != "cpu":
            piece = piece.cpu()
        hi = lo + piece.numel()
        slots = self.bucket.slots
        # one view of the piece's bytes, sliced per slot: a torch view per slot cost ~5x the
        # hashing itself on a small model (docs/architecture.md, "Weight sync")
        raw, size = tensor_bytes(piece), piece.element_size()
        while len(self.sums) < len(slots):
            slot = slots[len(self.sums)]
            start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if start > end or (start == end and slot.numel):
                break  # the slot starts in a later piece
            data = raw[(start - lo) * size : (end - lo) * size]
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

    @property
    def labels(self) -> list[str]:
        """What each checksum covers, for error messages: the tensors' names."""
        return [slot.name for slot in self.bucket.slots]


class ChecksumWorker:
    """Hashes pieces in a background thread, in the order they are added. When a bucket's
    last piece is hashed, `on_bucket(i, sums)` is called in that thread (the broadcaster
    appends the sums to the store there). `finish()` waits and returns every bucket's sums;
    it raises what a hash or `on_bucket` raised. `pool`: a one-thread executor kept across
    publishes by its owner (starting a thread per publish was the largest fixed cost of
    publishing a tiny model); None: a pool of its own, shut down by `finish()`. A send's last
    piece is hashed by `finish()` in the caller's thread: no packing follows for its hash to
    overlap with, and waking the pool for it cost more than the hash (docs/architecture.md)."""

    def __init__(
        self,
        on_bucket: Callable[[int, list[int]], None] | None = None,
        pool: ThreadPoolExecutor | None = None,
    ) -> None:
        self.on_bucket = on_bucket
        self._own_pool = pool is None
        self._pool = pool or ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync-checksums")
        self._futures: list[Future] = []
        self._hashers: dict[int, SlotHasher] = {}
        self._sums: dict[int, list[int]] = {}
        self._last: tuple[int, SlotHasher, torch.Tensor, int] | None = None

    def add(self, i: int, bucket: Bucket, piece: torch.Tensor, lo: int, last: bool = False) -> None:
        """Piece `[lo, lo + piece.numel())` of bucket `i` (a host tensor not written any more);
        `last`: the send's final piece (hashed by `finish()`, after every earlier one)."""
        hasher = self._hashers.setdefault(i, SlotHasher(bucket))
        if last:
            self._last = (i, hasher, piece, lo)
        else:
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
            if self._last is not None:
                self._hash(*self._last)
        finally:
            if self._own_pool:
                self._pool.shutdown(wait=True)
        return [self._sums[i] for i in sorted(self._sums)]


# -- wsum32: a position-weighted sum, computed on any device ----------------------------------

_WSUM_MULTIPLIER = 0x4F1BBCDD  # odd, below 2^31 (2^31 / golden ratio)
_U64 = (1 << 64) - 1


def piece_wsum(piece: torch.Tensor, lo: int) -> torch.Tensor:
    """wsum32 of elements `[lo, lo + piece.numel())` of a bucket: the piece's bytes as unsigned
    words (1-byte dtypes: bytes; 2-byte: 16-bit words; 4- and 8-byte: 32-bit words), each
    multiplied by an odd 31-bit number derived from the word's index in the bucket, keeping the
    product's low 32 bits, summed in int64. Returns a 0-dim int64 tensor on the piece's device
    (no synchronisation). Any change of one word changes the sum (odd multipliers make the
    product a bijection mod 2^32); a misplaced word changes it too (the multiplier depends on
    the position). A checksum against transport and copy faults, not a cryptographic hash: two
    errors can cancel with a chance of about 2^-32. Every step is int64 with explicit masks and
    no overflow, so any device (and a compiler that widens or fuses) gives the same value."""
    size = piece.element_size()
    flat = piece.detach().contiguous().reshape(-1)
    if size == 1:
        words = flat.view(torch.uint8).to(torch.int64)
    elif size == 2:
        words = flat.view(torch.int16).to(torch.int64) & 0xFFFF
    else:
        words = flat.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    first = lo * max(1, size // 4)  # index of the piece's first word in the bucket
    index = torch.arange(first, first + words.numel(), dtype=torch.int64, device=flat.device)
    # operands below 2^32 and 2^31: no product overflows int64 (overflow is undefined in C++)
    multipliers = (((index & 0xFFFFFFFF) * _WSUM_MULTIPLIER) & 0x7FFFFFFF) | 1
    return ((words * multipliers) & 0xFFFFFFFF).sum()


def wsum_words(sums: list[torch.Tensor]) -> list[int]:
    """Pieces' wsum32 tensors as unsigned 64-bit ints (one synchronisation for all of them)."""
    if not sums:
        return []
    return [v & _U64 for v in torch.stack(sums).tolist()]


class PieceSummer:
    """The wsum32 words of one bucket's pieces, fed in order, on the pieces' device: a
    receiver's wsum32 counterpart of `SlotHasher` (same `update`, `done`, `sums`, `labels`)."""

    def __init__(self, bucket: Bucket, index: int) -> None:
        self.bucket = bucket
        self.index = index  # the bucket's position in the layout, for labels
        self.labels: list[str] = []  # what each word covers: "bucket i elements lo+ (tensor)"
        self._pending: list[torch.Tensor] = []  # 0-dim sums, not synchronised yet
        self._next = 0  # first element not summed yet

    def update(self, piece: torch.Tensor, lo: int) -> None:
        """`piece`: elements `[lo, lo + piece.numel())` of the bucket, on any device."""
        if lo != self._next:
            raise ValueError(f"piece at element {lo}, expected {self._next}: pieces must come in order")
        self._pending.append(piece_wsum(piece, lo))
        name = next((s.name for s in self.bucket.slots if s.offset <= lo < s.offset + s.numel), "?")
        self.labels.append(f"bucket {self.index} elements {lo}+ ({name})")
        self._next = lo + piece.numel()

    @property
    def done(self) -> bool:
        return self._next >= self.bucket.numel

    @property
    def sums(self) -> list[int]:
        """One word per piece (synchronises with the device)."""
        return wsum_words(self._pending)


# -- the wire checksum: what the announced sums are, for both sides --------------------------


@dataclass(frozen=True)
class WireChecksum:
    """What the sums under `ws/ann/<seq>/sums` are: the announcement names one, the learner
    writes its sums by it (weight_sync.pipeline.SendSums) and receivers verify by it
    (`checker`), so the two sides cannot disagree on what is summed."""

    name: str  # as announced (WeightsAnnouncement.checksum)
    per_piece: bool  # wsum32: one word per piece, taken where the piece is; xxh3: one per tensor

    @property
    def unit(self) -> str:
        """What one sum covers, for error messages."""
        return "pieces" if self.per_piece else "tensors"

    def checker(self, bucket: Bucket, index: int) -> SlotHasher | PieceSummer:
        """A receiver's verifier of bucket `index` of the layout, fed its pieces in order."""
        return PieceSummer(bucket, index) if self.per_piece else SlotHasher(bucket)


XXH3 = WireChecksum("xxh3", per_piece=False)
WSUM32 = WireChecksum("wsum32", per_piece=True)
WIRE_CHECKSUMS = {c.name: c for c in (XXH3, WSUM32)}
