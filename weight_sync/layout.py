"""How a model's parameters are packed into flat buckets, and the announcement of a version.

The learner plans the layout (buckets by dtype, about `bucket_bytes` each), packs parameters
into flat buffers bucket by bucket, and announces `(version, layout, checksums)` before the
data. Receivers allocate the same buckets, receive them, verify each checksum, and unpack
named views. The layout is plain data (msgspec), so it travels in msgpack like every header.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import msgspec
import torch
import xxhash

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


class TensorSlot(msgspec.Struct, frozen=True):
    name: str  # parameter name (Hugging Face naming, which vLLM's load_weights also takes)
    shape: list[int]
    offset: int  # first element inside the bucket
    numel: int


class Bucket(msgspec.Struct, frozen=True):
    dtype: str  # key of TORCH_DTYPES; every slot of the bucket has this dtype
    numel: int
    slots: list[TensorSlot]

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=TORCH_DTYPES[self.dtype]).element_size()


class Announcement(msgspec.Struct, frozen=True):
    """Written by the broadcaster before a version's data; read by every receiver."""

    kind: Literal["weights", "shutdown"]
    version: int = -1  # policy version the weights are (learner optimizer steps)
    buckets: list[Bucket] = []
    checksums: list[int] = []  # xxh3_64 of each bucket's bytes, in bucket order


def plan_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, cast_to: torch.dtype | None = None
) -> list[Bucket]:
    """Greedy packing in parameter order, one dtype per bucket. A tensor larger than a bucket
    gets a bucket of its own; tensors are never split."""
    open_: dict[str, list[TensorSlot]] = {}
    fill: dict[str, int] = {}
    buckets: list[Bucket] = []
    for name, tensor in named:
        dtype = cast_to if (cast_to is not None and tensor.is_floating_point()) else tensor.dtype
        key = DTYPE_NAMES[dtype]
        item = torch.empty((), dtype=dtype).element_size()
        numel = tensor.numel()
        if key in open_ and (fill[key] + numel) * item > bucket_bytes:
            buckets.append(Bucket(key, fill[key], open_.pop(key)))
            fill[key] = 0
        slots = open_.setdefault(key, [])
        slots.append(TensorSlot(name, list(tensor.shape), fill.get(key, 0), numel))
        fill[key] = fill.get(key, 0) + numel
    for key, slots in open_.items():
        buckets.append(Bucket(key, fill[key], slots))
    return buckets


def pack_bucket(bucket: Bucket, params: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """One flat tensor holding the bucket's parameters (cast to the bucket dtype)."""
    flat = torch.empty(bucket.numel, dtype=TORCH_DTYPES[bucket.dtype], device=device)
    for slot in bucket.slots:
        flat[slot.offset : slot.offset + slot.numel].copy_(params[slot.name].detach().reshape(-1))
    return flat


def empty_bucket(bucket: Bucket, device: torch.device) -> torch.Tensor:
    return torch.empty(bucket.numel, dtype=TORCH_DTYPES[bucket.dtype], device=device)


def unpack_bucket(bucket: Bucket, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Named views into a received bucket (no copies)."""
    return [(s.name, flat[s.offset : s.offset + s.numel].view(s.shape)) for s in bucket.slots]


def checksum(flat: torch.Tensor) -> int:
    """xxh3_64 of the tensor's bytes (computed on host memory)."""
    host = flat.detach().contiguous()
    if host.device.type != "cpu":
        host = host.cpu()
    return xxhash.xxh3_64_intdigest(memoryview(host.view(torch.uint8).numpy()))


def total_bytes(buckets: Sequence[Bucket]) -> int:
    return sum(b.nbytes for b in buckets)


def describe(buckets: Sequence[Bucket]) -> str:
    mib = total_bytes(buckets) / 2**20
    n = sum(len(b.slots) for b in buckets)
    return f"{n} tensors in {len(buckets)} buckets, {mib:.1f} MiB"
