"""Bucket buffers reused from version to version.

A fresh multi-GB buffer per version costs a page fault per 4 KiB page on first touch, which
on a CPU host is about as expensive as the broadcast itself. Buffers of a version that is no
longer needed are *retired* to the pool; one is handed out again only once no view of it is
alive anywhere (the rollout loop dropped the version it loaded, no ZeroMQ zero-copy frame or
snapshot lease still refers to it). That is read from the storage's reference count; where
this torch build does not expose it, nothing is reused (correct, only slower).

Never retire a buffer that a failed or abandoned collective may still write into: those go
to the group's teardown, not here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from sluice.weight_sync.layout import TORCH_DTYPES, Bucket

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def only_owner(tensor: torch.Tensor) -> bool:
    """Whether no other tensor (view) shares this tensor's memory right now."""
    if _use_count is None:
        return False
    # references: the tensor itself and the temporary storage object made to ask
    return _use_count(tensor.untyped_storage()._cdata) <= 2


class BufferPool:
    def __init__(self, device: torch.device, *, pin: bool = False, max_bytes: int = 0) -> None:
        """`pin`: page-locked host buffers (fast copies to and from an accelerator).
        `max_bytes`: retired bytes kept at most (0: no limit)."""
        self.device = device
        self.pin = pin and device.type == "cpu" and torch.cuda.is_available()
        self.max_bytes = max_bytes
        self._retired: list[torch.Tensor] = []
        self.reused = 0
        self.allocated = 0

    def get(self, bucket: Bucket) -> torch.Tensor:
        dtype = TORCH_DTYPES[bucket.dtype]
        for i, t in enumerate(self._retired):
            if t.dtype == dtype and t.numel() == bucket.numel and only_owner(t):
                self.reused += 1
                return self._retired.pop(i)
        self.allocated += 1
        return torch.empty(bucket.numel, dtype=dtype, device=self.device, pin_memory=self.pin)

    def retire(self, buffers: Iterable[torch.Tensor]) -> None:
        """These buffers' version is no longer needed here; views handed out may still live.
        Accelerator memory is not kept: its caching allocator reuses freed blocks already, and
        a second copy of the model there would cost memory the engine needs."""
        if self.device.type != "cpu":
            return
        self._retired.extend(buffers)
        if self.max_bytes:
            while sum(t.numel() * t.element_size() for t in self._retired) > self.max_bytes:
                self._retired.pop(0)
