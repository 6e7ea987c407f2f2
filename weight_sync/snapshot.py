"""The last published version, kept in host memory on learner rank 0.

A snapshot is immutable once built. It is what a late joiner pulls over ZeroMQ, what a
publish that failed half way is sent again from (without gathering the weights a second
time), and the base a delta is computed against. On a CPU learner its buckets are the very
buffers that were broadcast (no copy); on an accelerator each bucket is copied to host as it
is packed. Its cost is one copy of the model in the wire dtype in host memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from sluice.weight_sync.layout import Bucket, TensorSlot


@dataclass(frozen=True)
class SnapshotTensor:
    name: str
    dtype: str
    shape: list[int]
    data: torch.Tensor  # flat host view into its bucket
    checksum: int


@dataclass(frozen=True)
class Snapshot:
    version: int
    buckets: list[Bucket]
    flats: list[torch.Tensor]  # host, one per bucket
    sums: list[list[int]]  # xxh3-64 per tensor, per bucket in slot order
    _by_name: dict[str, tuple[int, TensorSlot, int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for i, bucket in enumerate(self.buckets):
            for j, slot in enumerate(bucket.slots):
                self._by_name[slot.name] = (i, slot, self.sums[i][j])

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def tensors(self) -> Iterator[SnapshotTensor]:
        for i, bucket in enumerate(self.buckets):
            for j, slot in enumerate(bucket.slots):
                yield self._tensor(i, slot, self.sums[i][j])

    def tensor(self, name: str) -> SnapshotTensor:
        i, slot, sum_ = self._by_name[name]
        return self._tensor(i, slot, sum_)

    def checksum_of(self, name: str) -> int | None:
        entry = self._by_name.get(name)
        return None if entry is None else entry[2]

    def _tensor(self, i: int, slot: TensorSlot, sum_: int) -> SnapshotTensor:
        data = self.flats[i][slot.offset : slot.offset + slot.numel]
        return SnapshotTensor(slot.name, self.buckets[i].dtype, slot.shape, data, sum_)
