"""What verifying a broadcast costs per GB, by wire checksum, on the device the weights are on.

A receiver verifies every piece it gets (weight_sync.checksums). Two ways, measured here on
the same bytes (a bf16 bucket of `--mb` MiB, cut into `--piece-mb` pieces like a broadcast):
  xxh3    per tensor, of host bytes: on an accelerator a device-to-host copy (pageable, as the
          receiver does, or page-locked), then xxh3 on one CPU core (the default on gloo);
  wsum32  per piece, computed where the bytes are with torch ops (the default on nccl/hccl);
  wsum32 compiled  the same function through torch.compile (exploratory: one fused kernel).
and, as the yardstick, a device-to-device copy of the same bytes (what the memory does).

It also checks that wsum32 gives the same words on the device as on the CPU, for a bucket
packed from a model-like layout (slots at odd offsets), which learner and receivers rely on.

    python benchmarks/wire_checksum.py                 # CPU: xxh3 against wsum32
    python benchmarks/wire_checksum.py --device cuda   # on a GPU

Prints a table (rich) and writes JSON (default benchmarks/results/wire_checksum.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import xxhash

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sluice.weight_sync.checksums import SlotHasher, piece_wsum, wsum_words  # noqa: E402
from sluice.weight_sync.layout import TensorSpec, pack_bucket, piece_bounds, plan_buckets  # noqa: E402


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up."""
    fn()
    synchronize(device)
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def model_like_bucket(mb: float, device: torch.device):
    """A bf16 bucket of about `mb` MiB holding tensors of awkward sizes (odd offsets)."""
    gen = torch.Generator().manual_seed(0)
    specs, tensors, total = [], {}, 0
    sizes = [(4864, 896), (896,), (128, 896), (3,), (896, 4864), (1,), (151, 896)]
    i = 0
    while total < mb * 2**20 / 2:
        shape = sizes[i % len(sizes)]
        name = f"t{i}"
        tensors[name] = torch.randn(shape, generator=gen).to(device)
        specs.append(TensorSpec(name, shape, torch.float32))
        total += torch.Size(shape).numel()
        i += 1
    (bucket,) = plan_buckets(specs, 2**40, cast_to=torch.bfloat16)
    flat = torch.empty(bucket.numel, dtype=torch.bfloat16, device=device)
    pack_bucket(bucket, tensors, flat)
    return bucket, flat


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mb", type=float, default=1024.0, help="bucket size in MiB (bf16)")
    ap.add_argument("--piece-mb", type=float, default=16.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "wire_checksum.json")
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    console = Console()
    device = torch.device(args.device)
    bucket, flat = model_like_bucket(args.mb, device)
    nbytes = bucket.nbytes
    bounds = piece_bounds(bucket, int(args.piece_mb * 2**20))
    pieces = [(lo, flat[lo:hi]) for lo, hi in bounds]
    console.print(
        f"{nbytes / 1e9:.2f} GB bf16 bucket, {len(bucket.slots)} tensors, {len(pieces)} pieces, on {device}"
    )

    pinned = torch.empty(flat.numel(), dtype=flat.dtype, pin_memory=True) if device.type != "cpu" else None

    def xxh3_path(pin: bool) -> None:
        """pin: into one page-locked buffer allocated once; else `piece.cpu()` per piece, as
        receivers did on accelerators before wsum32."""
        hasher = SlotHasher(bucket)
        for lo, piece in pieces:
            if device.type == "cpu":
                host = piece
            elif pin:
                host = pinned[lo : lo + piece.numel()]
                host.copy_(piece)
            else:
                host = piece.cpu()
            hasher.update(host, lo)

    def wsum_path(fn) -> list[int]:
        return wsum_words([fn(piece, lo) for lo, piece in pieces])

    copy_out = torch.empty_like(flat)
    rows: dict[str, float] = {}
    rows["device copy (yardstick)"] = timed(lambda: copy_out.copy_(flat), device, args.repeats)
    if device.type != "cpu":
        rows["xxh3, pageable D2H"] = timed(lambda: xxh3_path(False), device, max(1, args.repeats // 2))
        rows["xxh3, page-locked D2H"] = timed(lambda: xxh3_path(True), device, max(1, args.repeats // 2))
    else:
        rows["xxh3"] = timed(lambda: xxh3_path(False), device, args.repeats)
    rows["wsum32"] = timed(lambda: wsum_path(piece_wsum), device, args.repeats)
    want = wsum_path(piece_wsum)
    compiled_error = ""
    if not args.no_compile:
        try:
            compiled = torch.compile(piece_wsum, dynamic=True)
            t0 = time.perf_counter()
            same = wsum_path(compiled) == want
            compile_s = time.perf_counter() - t0
            rows["wsum32 compiled"] = timed(lambda: wsum_path(compiled), device, args.repeats)
            if not same:
                compiled_error = "compiled wsum32 differs from eager"
        except Exception as e:  # exploratory: report why it did not run
            compiled_error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            compile_s = 0.0

    # the same words on the CPU as on the device, for a smaller bucket of the same layout
    sample_bucket, sample = model_like_bucket(min(args.mb, 64.0), device)
    sample_bounds = piece_bounds(sample_bucket, 2**20)
    on_device = wsum_words([piece_wsum(sample[lo:hi], lo) for lo, hi in sample_bounds])
    host = sample.cpu()
    on_cpu = wsum_words([piece_wsum(host[lo:hi], lo) for lo, hi in sample_bounds])
    xxh3_whole = xxhash.xxh3_64_intdigest(host.view(torch.uint8).numpy())

    table = Table(title=f"verifying {nbytes / 1e9:.2f} GB on {device} (median of {args.repeats})")
    for col in ("method", "seconds", "GB/s", "x device copy time"):
        table.add_column(col, justify="right")
    copy_s = rows["device copy (yardstick)"]
    for name, seconds in rows.items():
        table.add_row(name, f"{seconds:.4f}", f"{nbytes / seconds / 1e9:.1f}", f"{seconds / copy_s:.1f}")
    console.print(table)
    agree = on_device == on_cpu
    console.print(f"wsum32 on {device} equals wsum32 on cpu for {len(sample_bounds)} pieces: {agree}")
    if compiled_error:
        console.print(f"[yellow]wsum32 compiled: {compiled_error}")
    result = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "bytes": nbytes,
        "pieces": len(pieces),
        "piece_mb": args.piece_mb,
        "seconds": rows,
        "gbps": {k: nbytes / v / 1e9 for k, v in rows.items()},
        "wsum32_device_equals_cpu": agree,
        "compiled_error": compiled_error,
        "compile_seconds": compile_s if not args.no_compile else None,
        "sample_xxh3": xxh3_whole,
        "machine": {"platform": platform.platform(), "torch": torch.__version__},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {args.out}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
