"""The send half of a publish: pieces on the wire, and the checksums that go with them.

`WeightBroadcaster._send` announces a version and hands its buckets to a `PiecePipeline`,
which broadcasts them piece by piece with a bounded number in flight, while `SendSums` puts
each bucket's checksums where the announced `WireChecksum` says receivers look for them.
Kept apart from the broadcaster so that each step reads on its own; the protocol is in
docs/architecture.md, "Weight sync" (Publishing, Wire checksums).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from sluice.weight_sync.checksums import ChecksumWorker, WireChecksum, piece_wsum, wsum_words
from sluice.weight_sync.group import BroadcastGroup, CollectiveError, wait_work
from sluice.weight_sync.layout import Bucket, piece_bounds

# A piece of a bucket: (what to broadcast, on the group's device; its host copy, or None when
# the bucket's checksums are known already; its wsum32 taken where it was packed, or None when
# the wire checksum is xxh3)
Piece = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
# produce(i, bucket, bounds, wire_sums) -> the bucket's pieces, in the order of `bounds`
# ([lo, hi) each); wire_sums: take each piece's wsum32
Producer = Callable[[int, Bucket, list[tuple[int, int]], bool], Iterator[Piece]]


def flat_pieces(
    flat: torch.Tensor, bounds: list[tuple[int, int]], device: torch.device, wire_sums: bool
) -> Iterator[Piece]:
    """The pieces of a bucket packed already (a snapshot's, a delta's), moved to the wire's
    device; their wsum32 taken there."""
    for lo, hi in bounds:
        wire = flat[lo:hi].to(device)
        yield wire, None, piece_wsum(wire, lo) if wire_sums else None


class SendSums:
    """One send's checksums on the learner, by the announced `WireChecksum`: xxh3 sums known
    already (a resend, a delta) are appended ahead of each bucket's data; otherwise every
    piece's host copy is hashed in the background while the next piece is packed, and (xxh3
    on the wire) a bucket's sums are appended once its last piece is hashed; wsum32 words,
    taken where each piece was packed, are appended after the bucket's last piece.
    `append(i, sums)`: writes bucket i's sums to the store; None when nobody receives."""

    def __init__(
        self,
        wire: WireChecksum,
        append: Callable[[int, list[int]], None] | None,
        known: list[list[int]] | None,
        pool: ThreadPoolExecutor,
    ) -> None:
        self.wire = wire
        self._append = append
        self._known = known
        on_hashed = append if not wire.per_piece else None
        self._worker = ChecksumWorker(on_hashed, pool) if known is None else None
        self._words: list[torch.Tensor] = []  # the current bucket's wsum32, not synchronised

    def begin(self, i: int) -> None:
        self._words = []
        if self._known is not None and self._append is not None and not self.wire.per_piece:
            self._append(i, self._known[i])  # known already: before the data

    def add(self, i: int, bucket: Bucket, piece: Piece, lo: int, last: bool = False) -> None:
        """`last`: the send's final piece (nothing is packed after it)."""
        _, host, wsum = piece
        if self._worker is not None:
            if host is None:
                raise ValueError(f"bucket {i}: a piece without its host copy, and no checksums known")
            self._worker.add(i, bucket, host, lo, last)  # hashed while the next piece is packed
        if wsum is not None:
            self._words.append(wsum)

    def end(self, i: int) -> None:
        if self.wire.per_piece and self._append is not None:
            self._append(i, wsum_words(self._words))  # follow the data

    def finish(self) -> list[list[int]]:
        """Every bucket's xxh3 (the snapshot's); raises what the hashing thread raised."""
        if self._worker is not None:
            return self._worker.finish()
        return self._known or []


class PiecePipeline:
    """Broadcasts one send's pieces, at most `depth` in flight. The first collective error is
    kept in `error` and no broadcast starts after it, but every bucket is still produced:
    learner ranks gather in lockstep, and the snapshot needs every bucket. `group` None: only
    produce (nothing to send to, or building a snapshot to send later)."""

    def __init__(
        self,
        group: BroadcastGroup | None,
        depth: int,
        timeout_s: float,
        liveness: Callable[[], bool] | None,
    ) -> None:
        self.group = group
        self.depth = depth
        self.timeout_s = timeout_s
        self.liveness = liveness  # polled while waiting: True aborts the wait
        self.error: CollectiveError | None = None
        self._inflight: deque[tuple[dist.Work, torch.Tensor]] = deque()

    def send(
        self, layout: list[Bucket], produce: Producer, sums: SendSums, piece_bytes: int
    ) -> list[list[int]]:
        """Produce and broadcast every bucket piece by piece, each piece's checksum to `sums`,
        then wait for the last broadcasts. Returns every bucket's xxh3 (`sums.finish()`)."""
        try:
            for i, bucket in enumerate(layout):
                bounds = piece_bounds(bucket, piece_bytes)
                sums.begin(i)
                pieces = produce(i, bucket, bounds, sums.wire.per_piece)
                for k, ((lo, _), piece) in enumerate(zip(bounds, pieces, strict=True)):
                    self._start(piece[0])
                    sums.add(i, bucket, piece, lo, last=i == len(layout) - 1 and k == len(bounds) - 1)
                    self._drain(keep=self.depth - 1)
                sums.end(i)
        finally:
            hashed = sums.finish()
        self._drain(keep=0)
        return hashed

    def pending(self) -> list[tuple[dist.Work, torch.Tensor]]:
        """Broadcasts never waited for (after an error): released with the group, not here."""
        return list(self._inflight)

    def _start(self, wire: torch.Tensor) -> None:
        if self.group is None or self.error is not None:
            return
        try:
            self._inflight.append((self.group.broadcast_async(wire), wire))
        except CollectiveError as e:
            self.error = e

    def _drain(self, keep: int) -> None:
        """Wait for the oldest broadcasts until at most `keep` are in flight or one failed."""
        while self._inflight and self.error is None and len(self._inflight) > keep:
            try:
                wait_work(self._inflight.popleft()[0], self.timeout_s, self.liveness, poll_s=0.25)
            except CollectiveError as e:
                self.error = e
