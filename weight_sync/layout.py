"""How a model's tensors are packed into flat buckets, and how their bytes are checksummed.

The learner plans the layout (tensors grouped by wire dtype into buckets of about
`bucket_bytes`, in the source's order), packs tensors into flat buffers bucket by bucket
(casting floating-point tensors to the wire dtype on the way), and checksums every tensor's
bytes. Receivers allocate the same buckets, receive them, verify each tensor's checksum, and
unpack named views. The layout is plain data (msgspec), so it travels in msgpack like every
header.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import torch
import xxhash

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


@dataclass(frozen=True)
class TensorSpec:
    """What a parameter source declares about one tensor: its full (unsharded) shape."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class TensorSlot(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str  # parameter name (Hugging Face naming, which vLLM's load_weights also takes)
    shape: list[int]
    offset: int  # first element inside the bucket
    numel: int


class Bucket(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    dtype: str  # key of TORCH_DTYPES; every slot of the bucket has this dtype
    numel: int
    slots: list[TensorSlot]

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.slots]


def itemsize(dtype: str) -> int:
    """Bytes per element of a wire dtype (`Bucket.nbytes` asks many times a publish: the dtype's
    own attribute, no tensor made)."""
    return TORCH_DTYPES[dtype].itemsize


def wire_dtype(dtype: torch.dtype, cast_to: torch.dtype | None) -> torch.dtype:
    """Floating-point tensors travel as `cast_to` (when given); others keep their dtype."""
    return cast_to if (cast_to is not None and dtype.is_floating_point) else dtype


def plan_buckets(
    specs: Iterable[TensorSpec], bucket_bytes: int, cast_to: torch.dtype | None = None
) -> list[Bucket]:
    """Greedy packing in source order, one dtype per bucket. A tensor larger than a bucket
    gets a bucket of its own; tensors are never split (so a sharded source can gather a
    bucket's tensors whole)."""
    open_: dict[str, list[TensorSlot]] = {}
    fill: dict[str, int] = {}
    buckets: list[Bucket] = []
    for spec in specs:
        key = DTYPE_NAMES[wire_dtype(spec.dtype, cast_to)]
        size = itemsize(key)
        if key in open_ and (fill[key] + spec.numel) * size > bucket_bytes:
            buckets.append(Bucket(key, fill[key], open_.pop(key)))
            fill[key] = 0
        slots = open_.setdefault(key, [])
        slots.append(TensorSlot(spec.name, list(spec.shape), fill.get(key, 0), spec.numel))
        fill[key] = fill.get(key, 0) + spec.numel
    for key, slots in open_.items():
        buckets.append(Bucket(key, fill[key], slots))
    return buckets


def empty_bucket(bucket: Bucket, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.empty(bucket.numel, dtype=TORCH_DTYPES[bucket.dtype], device=device)


def piece_bounds(bucket: Bucket, piece_bytes: int) -> list[tuple[int, int]]:
    """How a bucket goes over the wire: element ranges `[lo, hi)` in order, one broadcast
    each. A bucket of at most `piece_bytes` (or `piece_bytes` 0) is one piece; a larger one
    (a tensor bigger than a bucket, e.g. the embedding) is split into near-equal pieces, so
    its first bytes are on the wire while the rest is still being cast."""
    if piece_bytes <= 0 or bucket.nbytes <= piece_bytes:
        return [(0, bucket.numel)]
    n = min(-(-bucket.nbytes // piece_bytes), bucket.numel)  # never an empty piece
    cuts = [bucket.numel * k // n for k in range(n + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def pack_bucket(
    bucket: Bucket,
    tensors: Mapping[str, torch.Tensor],
    out: torch.Tensor,
    lo: int = 0,
    hi: int | None = None,
) -> torch.Tensor:
    """Copy the bucket's tensors (elements `[lo, hi)` of the bucket, default all) into `out`
    (a flat tensor of the bucket's dtype), casting to the bucket dtype on the way: straight
    from the source into the buffer, no intermediate."""
    hi = bucket.numel if hi is None else hi
    src: list[torch.Tensor] = []
    first = at = -1  # the elements [first, at) of `out` the piece's slices fill, back to back
    for slot in bucket.slots:
        start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if start >= end:
            continue
        tensor = tensors[slot.name].detach()
        if tensor.numel() != slot.numel:
            raise ValueError(
                f"tensor {slot.name!r} has {tensor.numel()} elements, the layout says {slot.numel}"
            )
        if not src:
            first = start
        elif start != at:
            raise ValueError(f"slot {slot.name!r} starts at element {start}, the one before ends at {at}")
        at = end
        src.append(tensor.reshape(-1)[start - slot.offset : end - slot.offset])
    if src:  # one op for the piece (casting): a copy_ per slice cost ~1.5x on a small model
        torch.cat(src, out=out[first:at])
    return out


def unpack_bucket(bucket: Bucket, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Named views into a bucket (no copies)."""
    return [(s.name, flat[s.offset : s.offset + s.numel].view(s.shape)) for s in bucket.slots]


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without copying."""
    if tensor.device.type != "cpu":
        raise ValueError("tensor_bytes needs a host tensor")
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data


def checksum(tensor: torch.Tensor) -> int:
    """xxh3-64 of a host tensor's bytes (xxhash releases the GIL: a collective moving other
    bytes in its own thread is not held up)."""
    return xxhash.xxh3_64_intdigest(tensor_bytes(tensor))


def slot_checksums(bucket: Bucket, host_flat: torch.Tensor) -> list[int]:
    """One checksum per tensor of the bucket, in slot order."""
    return [checksum(host_flat[s.offset : s.offset + s.numel]) for s in bucket.slots]


def encode_checksums(sums: Sequence[int]) -> bytes:
    """Checksums as little-endian uint64 words (how they are appended to the store)."""
    return np.asarray(sums, dtype="<u8").tobytes()


def decode_checksums(raw: bytes) -> list[int]:
    if len(raw) % 8:
        raise ValueError(f"checksum record of {len(raw)} bytes is not a multiple of 8")
    return [int(x) for x in np.frombuffer(raw, dtype="<u8")]


def total_bytes(buckets: Sequence[Bucket]) -> int:
    return sum(b.nbytes for b in buckets)


def describe(buckets: Sequence[Bucket]) -> str:
    mib = total_bytes(buckets) / 2**20
    n = sum(len(b.slots) for b in buckets)
    return f"{n} tensors in {len(buckets)} buckets, {mib:.1f} MiB"
