"""Pieces and piecewise checksums: a bucket sent in pieces is packed and checksummed exactly as
in one go, whatever the piece size (tensors spanning pieces, empty tensors, mixed sizes)."""

from __future__ import annotations

import threading

import pytest
import torch

from sluice.weight_sync.checksums import ChecksumWorker, PieceSummer, SlotHasher, piece_wsum, wsum_words
from sluice.weight_sync.layout import (
    TensorSpec,
    empty_bucket,
    pack_bucket,
    piece_bounds,
    plan_buckets,
    slot_checksums,
)


def make_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    shapes = {"emb": (97, 13), "empty": (0,), "b": (5,), "w": (31, 7), "one": (1,), "tail": (64,)}
    return {n: torch.randn(s, generator=gen) for n, s in shapes.items()}


def one_bucket(tensors):
    specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    (bucket,) = plan_buckets(specs, 2**30, cast_to=torch.bfloat16)
    return bucket


@pytest.mark.parametrize("piece_bytes", [0, 1, 2, 6, 100, 1000, 2**30])
def test_pieces_pack_and_hash_like_the_whole_bucket(piece_bytes):
    tensors = make_tensors()
    bucket = one_bucket(tensors)
    whole = pack_bucket(bucket, tensors, empty_bucket(bucket))
    bounds = piece_bounds(bucket, piece_bytes)
    assert bounds[0][0] == 0 and bounds[-1][1] == bucket.numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:])) and all(lo < hi for lo, hi in bounds)
    if piece_bytes:
        assert all((hi - lo) * 2 <= max(piece_bytes, 2) for lo, hi in bounds)
    out = torch.full_like(whole, float("nan"))
    hasher = SlotHasher(bucket)
    for lo, hi in bounds:
        pack_bucket(bucket, tensors, out, lo, hi)
        assert not hasher.done or hi == lo
        hasher.update(out[lo:hi], lo)
    assert torch.equal(out.view(torch.int16), whole.view(torch.int16))
    assert hasher.done and hasher.sums == slot_checksums(bucket, whole)


def test_pieces_out_of_order_are_an_error():
    tensors = make_tensors()
    bucket = one_bucket(tensors)
    flat = pack_bucket(bucket, tensors, empty_bucket(bucket))
    (lo0, hi0), (lo1, hi1) = piece_bounds(bucket, bucket.nbytes // 2 + 2)
    with pytest.raises(ValueError, match="in order"):
        SlotHasher(bucket).update(flat[lo1:hi1], lo1)


def test_a_piece_with_a_wrong_tensor_is_an_error():
    tensors = make_tensors()
    bucket = one_bucket(tensors)
    tensors["w"] = torch.zeros(3)
    with pytest.raises(ValueError, match="'w' has 3 elements"):
        pack_bucket(bucket, tensors, empty_bucket(bucket))


@pytest.mark.parametrize("mark_last", [False, True], ids=["pool-only", "last-piece-inline"])
def test_checksum_worker_reports_every_bucket_in_order(mark_last):
    tensors = make_tensors()
    specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    layout = plan_buckets(specs, 300)
    assert len(layout) >= 3
    reported: list[tuple[int, str]] = []
    worker = ChecksumWorker(lambda i, sums: reported.append((i, threading.current_thread().name)))
    flats = []
    for i, bucket in enumerate(layout):
        flat = pack_bucket(bucket, tensors, empty_bucket(bucket))
        flats.append(flat)
        bounds = piece_bounds(bucket, 64)
        for k, (lo, hi) in enumerate(bounds):
            last = mark_last and i == len(layout) - 1 and k == len(bounds) - 1
            worker.add(i, bucket, flat[lo:hi], lo, last=last)
    assert len(reported) < len(layout) or not mark_last  # the last piece waits for finish()
    sums = worker.finish()
    assert [i for i, _ in reported] == list(range(len(layout)))
    assert sums == [slot_checksums(b, f) for b, f in zip(layout, flats)]
    # every bucket hashed in the pool, except the last one's final piece where it was marked
    caller = threading.current_thread().name
    assert [name == caller for _, name in reported] == [False] * (len(layout) - 1) + [mark_last]


def test_checksum_worker_raises_what_the_callback_raised():
    tensors = make_tensors()
    bucket = one_bucket(tensors)
    flat = pack_bucket(bucket, tensors, empty_bucket(bucket))

    def fail(i, sums):
        raise ConnectionError("store gone")

    worker = ChecksumWorker(fail)
    worker.add(0, bucket, flat, 0)
    with pytest.raises(ConnectionError, match="store gone"):
        worker.finish()


WSUM_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.uint8,
    torch.bool,
]


def sample(dtype: torch.dtype, n: int = 1001) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return (torch.randn(n, generator=gen) * 100).to(dtype)


@pytest.mark.parametrize("dtype", WSUM_DTYPES)
def test_wsum32_of_pieces_adds_up_to_the_whole_and_sees_every_flipped_bit(dtype):
    t = sample(dtype)
    (whole,) = wsum_words([piece_wsum(t, 0)])
    for cut in (1, 400, 1000):
        parts = wsum_words([piece_wsum(t[:cut], 0), piece_wsum(t[cut:], cut)])
        assert sum(parts) % 2**64 == whole  # a per-element sum: pieces are independent
    raw = t.view(torch.uint8)
    for byte in range(0, raw.numel(), 7):  # every 7th byte, each bit of it
        for bit in range(8):
            if dtype == torch.bool and bit:
                continue  # a bool is 0 or 1
            flipped = t.clone()
            flipped.view(torch.uint8)[byte] ^= 1 << bit
            assert wsum_words([piece_wsum(flipped, 0)])[0] != whole, (byte, bit)


def test_wsum32_sees_swapped_and_shifted_data():
    t = sample(torch.bfloat16)
    (whole,) = wsum_words([piece_wsum(t, 0)])
    swapped = t.clone()
    swapped[[10, 11]] = swapped[[11, 10]]
    assert t[10] != t[11] and wsum_words([piece_wsum(swapped, 0)])[0] != whole
    assert wsum_words([piece_wsum(t, 1)])[0] != whole  # the same bytes at another place


def test_wsum32_values_are_pinned():
    """Learner and receivers must agree across versions and devices: a change of the algorithm
    shows here first (these values were computed on CPU and match CUDA, see the benchmark)."""
    values = [wsum_words([piece_wsum(torch.arange(64, dtype=d), 5)])[0] for d in (torch.int64, torch.float32)]
    values.append(wsum_words([piece_wsum(torch.arange(64, dtype=torch.float32).to(torch.bfloat16), 5)])[0])
    assert values == PINNED_WSUMS


def test_piece_summer_gives_one_word_per_piece_in_order():
    tensors = make_tensors()
    bucket = one_bucket(tensors)
    flat = pack_bucket(bucket, tensors, empty_bucket(bucket))
    bounds = piece_bounds(bucket, 100)
    summer = PieceSummer(bucket, index=3)
    for lo, hi in bounds:
        assert not summer.done
        summer.update(flat[lo:hi], lo)
    assert summer.done
    assert summer.sums == wsum_words([piece_wsum(flat[lo:hi], lo) for lo, hi in bounds])
    assert summer.labels[0] == "bucket 3 elements 0+ (emb)" and len(summer.labels) == len(bounds)
    with pytest.raises(ValueError, match="pieces must come in order"):
        PieceSummer(bucket, 0).update(flat[bounds[1][0] : bounds[1][1]], bounds[1][0])


PINNED_WSUMS = [121441721184, 117293711360, 148520456000]


def test_a_layout_with_a_gap_between_slots_is_an_error():
    """Packing fills a piece with one op, which needs the slots back to back (as plan_buckets
    lays them out); a layout that leaves a gap is refused, naming the slot."""
    tensors = make_tensors()
    bucket = one_bucket(tensors)
    slots = [s if s.name != "w" else type(s)(s.name, s.shape, s.offset + 1, s.numel) for s in bucket.slots]
    gapped = type(bucket)(bucket.dtype, bucket.numel + 1, slots)
    with pytest.raises(ValueError, match="slot 'w' starts at element"):
        pack_bucket(gapped, tensors, empty_bucket(gapped))
