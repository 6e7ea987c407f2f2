"""Weight sync benchmark: deliver a 0.5B-parameter model to 1, 2 and 4 receiver processes.

For each receiver count, in the same run and over the same store and backend:
  raw    one torch.distributed broadcast of a flat tensor of the model's bytes, then a tiny
         allreduce so the time covers delivery to every receiver (the ceiling);
  sync   WeightBroadcaster.publish of the model (fp32 master weights, cast on the fly to the
         wire dtype, bucketed, pipelined, checksummed) until every receiver reported the
         version verified (SYNC_REPORT);
  pull   (1 receiver) the ZeroMQ chunked transfer of the same version a late joiner makes.
The ratio sync/raw bandwidth is the number to watch (target >= 0.8). Receivers are separate
processes (`--role receiver`), as rollout services are.

    python benchmarks/weight_sync.py                  # 0.5B params, bf16 wire, CPU/gloo
    python benchmarks/weight_sync.py --quick          # ~10M params: a smoke test
    python benchmarks/weight_sync.py --device cuda    # NCCL; needs receivers+1 GPUs
    python benchmarks/weight_sync.py --device cuda --receiver-device cpu
                                                      # one GPU: learner casts and packs on it,
                                                      # gloo to CPU receivers (picked by auto)

Prints a table (rich) and writes JSON (default benchmarks/results/weight_sync.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
# This file is named like the package it measures: keep its own folder off the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

from sluice.config.weight_sync import WeightSyncConfig  # noqa: E402
from sluice.net import free_port  # noqa: E402
from sluice.weight_sync.group import epoch_backend, make_group, wait_work  # noqa: E402

RAW_PREFIX = "bench/raw/"
PULL_KEY = "bench/pull"
PULL_RESULT_KEY = "bench/pull_result"


# -- the model -----------------------------------------------------------------------------------


def model_shapes(quick: bool) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen2.5-0.5B's parameter shapes (494M parameters, tied embeddings); --quick: a ~10M one."""
    hidden, inter, layers, vocab, kv = (896, 4864, 24, 151936, 128) if not quick else (256, 1024, 4, 8192, 64)
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.q_proj.bias", (hidden,)),
            (p + "self_attn.k_proj.weight", (kv, hidden)),
            (p + "self_attn.k_proj.bias", (kv,)),
            (p + "self_attn.v_proj.weight", (kv, hidden)),
            (p + "self_attn.v_proj.bias", (kv,)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    shapes.append(("model.norm.weight", (hidden,)))
    return shapes


class RandomModel(torch.nn.Module):
    def __init__(
        self, shapes: list[tuple[str, tuple[int, ...]]], device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        gen = torch.Generator(device=device).manual_seed(0)
        self._names = []
        for name, shape in shapes:
            key = name.replace(".", "__")
            t = (
                torch.empty(shape, dtype=torch.float32, device=device)
                .normal_(0, 0.02, generator=gen)
                .to(dtype)
            )
            self.register_parameter(key, torch.nn.Parameter(t, requires_grad=False))
            self._names.append((key, name))

    def named_parameters(self, *args, **kwargs):  # Hugging Face names, as a real model has
        for key, name in self._names:
            yield name, getattr(self, key)


# -- receiver process ----------------------------------------------------------------------------


def receiver_main(args: argparse.Namespace) -> int:
    from sluice.weight_sync.receiver import WeightReceiver
    from sluice.weight_sync.transfer_client import pull_snapshot

    torch.set_num_threads(1)
    device = torch.device(
        args.device if args.device == "cpu" else f"cuda:{args.rank % torch.cuda.device_count()}"
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = args.backend  # resolved by the learner, as an epoch commit names it
    cfg = WeightSyncConfig(
        master_port=args.master_port,
        timeout_s=300,
        publish_timeout_s=300,
        ready_timeout_s=60,
        liveness_timeout_s=60,
    )
    store = dist.TCPStore("127.0.0.1", args.master_port, None, is_master=False, wait_for_workers=False)
    # raw broadcasts: the ceiling
    group = make_group(
        backend,
        store,
        args.rank,
        args.world,
        epoch=0,
        prefix=RAW_PREFIX,
        connect_timeout_s=120,
        op_timeout_s=300,
    )
    on = ceiling_device(backend, device)
    flat = torch.empty(args.raw_bytes, dtype=torch.uint8, device=on)
    done = torch.zeros(1, device=on)
    for _ in range(args.repeats + 1):
        wait_work(group.broadcast_async(flat), 300)
        wait_work(group.pg.allreduce([done]), 300)
    group.close()
    del flat
    # weight sync: a receiver like every rollout service's
    receiver = WeightReceiver(
        cfg, service_id=f"bench-{args.rank}", control_endpoint=args.control, device=device
    )
    receiver.start()
    pulled = False
    while not receiver.finished.is_set():
        receiver.wait_for_weights(timeout_s=0.2)  # take and drop: an engine would load it here
        if args.rank == 1 and not pulled and store.check([PULL_KEY]):
            pulled = True
            endpoint = store.get("ws/transfer").decode()
            seconds = []
            for _ in range(int(store.get(PULL_KEY))):
                weights = pull_snapshot(endpoint, cfg.transfer, device=device)
                seconds.append(weights.seconds)
                del weights
            store.set(PULL_RESULT_KEY, json.dumps(seconds).encode())
    receiver.stop()
    return 0 if receiver.error is None else 1


# -- learner side --------------------------------------------------------------------------------


def run_case(args: argparse.Namespace, model: RandomModel, n: int, wire: torch.Tensor) -> dict:
    """`wire`: the model's wire bytes (`wire_bytes`), what the raw ceiling broadcasts."""
    import zmq

    from sluice.control.admission import AdmissionPolicy
    from sluice.control.server import ControlServer
    from sluice.weight_sync.broadcaster import WeightBroadcaster

    device = torch.device(args.device)
    backend = case_backend(args, n)
    cfg = WeightSyncConfig(
        master_port=free_port(),
        backend=args.backend,
        bucket_mb=args.bucket_mb,
        piece_mb=args.piece_mb,
        dtype=args.dtype,
        pipeline_depth=args.pipeline_depth,
        timeout_s=300,
        publish_timeout_s=300,
        ready_timeout_s=60,
        send="inline",  # times the whole publish in this thread, as each stats record says
        liveness_timeout_s=60,
    )
    control_endpoint = f"tcp://127.0.0.1:{free_port()}"
    control = ControlServer(control_endpoint, AdmissionPolicy(8, 1), ctx=zmq.Context())
    broadcaster = WeightBroadcaster(cfg, device)
    control.attach_membership(broadcaster.membership)
    control.start()
    broadcaster.start()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--role",
                "receiver",
                "--rank",
                str(i + 1),
                "--world",
                str(n + 1),
                "--master-port",
                str(cfg.master_port),
                "--control",
                control_endpoint,
                "--raw-bytes",
                str(wire.numel()),
                "--repeats",
                str(args.repeats),
                "--device",
                args.receiver_device,
                "--backend",
                backend,
            ],
            cwd=ROOT,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                "OMP_NUM_THREADS": "1",
            },
        )
        for i in range(n)
    ]
    try:
        raw = raw_broadcasts(backend, args, broadcaster.store, n, wire, device)
        wait_for(lambda: broadcaster.membership.registered() == n, 300, "receivers to join")
        sync, publish_only, send, confirm = [], [], [], []
        for version in range(args.repeats + 1):  # version 0 also forms the group: not timed
            t0 = time.perf_counter()
            stats = broadcaster.publish(version, model)
            t1 = time.perf_counter()
            wait_for(lambda v=version: all_report(broadcaster, v, n), 300, f"v{version} everywhere")
            if version > 0:
                publish_only.append(t1 - t0)
                send.append(stats.send_seconds)
                confirm.append(stats.confirm_seconds)
                sync.append(time.perf_counter() - t0)
            assert stats.members == n and stats.delivered, stats
        pull = []
        if n == 1:
            broadcaster.store.set(PULL_KEY, str(args.repeats).encode())
            wait_for(lambda: broadcaster.store.check([PULL_RESULT_KEY]), 600, "the pulls")
            pull = json.loads(broadcaster.store.get(PULL_RESULT_KEY))
    finally:
        broadcaster.close(leave_wait_s=10)
        control.close()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    if any(codes):
        raise RuntimeError(f"receiver processes exited with {codes}")
    return {
        "receivers": n,
        "raw_s": raw,
        "sync_s": sync,
        "publish_s": publish_only,
        "send_s": send,
        "confirm_s": confirm,
        "pull_s": pull,
    }


def produce_only(args: argparse.Namespace, model: RandomModel) -> list[float]:
    """Publishes with no receiver: the learner's own work per version (gather, cast and pack,
    checksums, snapshot), which a publish overlaps with the broadcast."""
    from sluice.weight_sync.broadcaster import WeightBroadcaster

    cfg = WeightSyncConfig(
        master_port=free_port(),
        bucket_mb=args.bucket_mb,
        piece_mb=args.piece_mb,
        dtype=args.dtype,
        pipeline_depth=args.pipeline_depth,
    )
    broadcaster = WeightBroadcaster(cfg, torch.device(args.device))
    broadcaster.start()
    try:
        times = []
        for version in range(args.repeats + 2):  # the first two fill the buffer pool
            t0 = time.perf_counter()
            broadcaster.publish(version, model)
            if version > 1:
                times.append(time.perf_counter() - t0)
        return times
    finally:
        broadcaster.close(leave_wait_s=0)


def wire_bytes(model: RandomModel, dtype: str) -> torch.Tensor:
    """The model's bytes as they go on the wire (cast to the wire dtype), in one flat tensor.
    The ceiling must send real bytes: an untouched `torch.empty` maps every page to the
    kernel's shared zero page, whose reads hit the cache, and inflated the ceiling by ~25%."""
    wire = getattr(torch, dtype)
    return torch.cat([p.detach().reshape(-1).to(wire) for _, p in model.named_parameters()]).view(torch.uint8)


def ceiling_device(backend: str, device: torch.device) -> torch.device:
    """Where the raw ceiling's tensor lives: host memory for gloo (its best case, and where the
    broadcaster puts gloo's wire tensors too), else the rank's device."""
    return device if backend != "gloo" else torch.device("cpu")


def case_backend(args: argparse.Namespace, n: int) -> str:
    """The backend the broadcaster's epoch will use with `n` receivers (weight_sync.group)."""
    return epoch_backend(
        args.backend, torch.device(args.device).type, [torch.device(args.receiver_device).type] * n
    )


def raw_broadcasts(
    backend: str, args, store, n: int, data: torch.Tensor, device: torch.device
) -> list[float]:
    group = make_group(
        backend, store, 0, n + 1, epoch=0, prefix=RAW_PREFIX, connect_timeout_s=120, op_timeout_s=300
    )
    on = ceiling_device(backend, device)
    flat = data.to(on)
    done = torch.zeros(1, device=on)
    times = []
    for i in range(args.repeats + 1):  # the first one warms the connections up: not timed
        t0 = time.perf_counter()
        wait_work(group.broadcast_async(flat), 300)
        wait_work(group.pg.allreduce([done]), 300)
        if i > 0:
            times.append(time.perf_counter() - t0)
    group.close()
    return times


def all_report(broadcaster, version: int, n: int) -> bool:
    members = broadcaster.membership.status().members
    return len(members) == n and all(m.version >= version for m in members.values())


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.001)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~10M parameters instead of 0.5B")
    ap.add_argument("--receivers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--device", default="cpu", help="learner device: cpu (gloo) or cuda (nccl)")
    ap.add_argument("--receiver-device", default=None, help="receivers' device (default: --device)")
    ap.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "gloo", "nccl"],
        help="auto: nccl when the learner and receivers are all on cuda, else gloo (as the "
        "broadcaster picks each epoch's backend)",
    )
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="wire dtype")
    ap.add_argument(
        "--param-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the model's parameters: float32 masters (cast while packing) or bfloat16 (a model "
        "trained in bf16: packing copies)",
    )
    ap.add_argument("--bucket-mb", type=float, default=None, help="default: the config's")
    ap.add_argument("--piece-mb", type=float, default=None, help="default: the config's")
    ap.add_argument("--pipeline-depth", type=int, default=None, help="default: the config's")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "weight_sync.json")
    ap.add_argument("--role", default="learner", choices=["learner", "receiver"], help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--master-port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--control", default="", help=argparse.SUPPRESS)
    ap.add_argument("--raw-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "receiver":
        return receiver_main(args)
    defaults = WeightSyncConfig()
    for name in ("bucket_mb", "piece_mb", "pipeline_depth"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(defaults, name))

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    console = Console()
    device = torch.device(args.device)
    args.receiver_device = args.receiver_device or args.device
    if case_backend(args, 1) == "nccl":
        gpus = torch.cuda.device_count()
        too_many = [n for n in args.receivers if n + 1 > gpus]
        if too_many:
            console.print(f"[yellow]NCCL needs one GPU per rank: {gpus} GPUs, skipping {too_many} receivers")
            args.receivers = [n for n in args.receivers if n + 1 <= gpus]
        if not args.receivers:
            console.print("[red]not enough GPUs for any receiver count")
            return 2
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    shapes = model_shapes(args.quick)
    with console.status("building the random model"):
        model = RandomModel(shapes, device, getattr(torch, args.param_dtype))
    n_params = sum(torch.Size(s).numel() for _, s in shapes)
    itemsize = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    nbytes = n_params * itemsize
    console.print(
        f"{n_params / 1e9:.3f}B parameters, {nbytes / 1e9:.2f} GB on the wire ({args.dtype}), "
        f"bucket {args.bucket_mb} MiB, piece {args.piece_mb} MiB, pipeline depth {args.pipeline_depth}, "
        f"device {args.device}, "
        f"receivers on {args.receiver_device}, backend {case_backend(args, 1)}"
    )
    with console.status("timing the learner's own work per publish"):
        produce = produce_only(args, model)
    wire = wire_bytes(model, args.dtype)  # once: every receiver count's ceiling sends these bytes
    cases = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("receiver counts", total=len(args.receivers))
        for n in args.receivers:
            progress.update(task, description=f"{n} receiver(s)")
            cases.append(run_case(args, model, n, wire))
            progress.advance(task)
    table = Table(title="weight sync: time to deliver one version to every receiver (median)")
    for col in (
        "receivers",
        "raw s",
        "raw GB/s",
        "sync s",
        "sync GB/s",
        "sync/raw",
        "send s",
        "confirm s",
        "pull s",
    ):
        table.add_column(col, justify="right")
    for case in cases:
        raw, sync = statistics.median(case["raw_s"]), statistics.median(case["sync_s"])
        case.update(
            raw_gbps=nbytes / raw / 1e9,
            sync_gbps=nbytes / sync / 1e9,
            ratio=raw / sync,
            raw_median_s=raw,
            sync_median_s=sync,
        )
        pull = f"{statistics.median(case['pull_s']):.2f}" if case["pull_s"] else "-"
        table.add_row(
            str(case["receivers"]),
            f"{raw:.2f}",
            f"{case['raw_gbps']:.2f}",
            f"{sync:.2f}",
            f"{case['sync_gbps']:.2f}",
            f"{case['ratio']:.2f}",
            f"{statistics.median(case['send_s']):.3f}",
            f"{statistics.median(case['confirm_s']):.3f}",
            pull,
        )
    console.print(table)
    console.print(
        "GB/s = model bytes / time to the last receiver; every receiver gets all of them. "
        "send = announcement to the learner's last broadcast done (packing overlaps it); "
        "confirm = then to every receiver's verified report."
    )
    console.print(
        f"learner work per publish without receivers (gather, cast, pack, checksum): "
        f"{statistics.median(produce):.2f} s"
    )
    result = {
        "params": n_params,
        "bytes": nbytes,
        "dtype": args.dtype,
        "bucket_mb": args.bucket_mb,
        "piece_mb": args.piece_mb,
        "pipeline_depth": args.pipeline_depth,
        "device": args.device,
        "receiver_device": args.receiver_device,
        "backend": case_backend(args, 1),
        "repeats": args.repeats,
        "produce_only_s": produce,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
