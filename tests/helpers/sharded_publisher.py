"""Test helper: one rank of a 2-rank learner whose weights are sharded (FSDP2 or DeepSpeed
ZeRO-3, gloo) publishing two versions to a weight-sync receiver. Rank 0 serves the control
plane and the broadcaster; rank 1 only takes part in the gathers. Rank 0 writes what the
receiver must have got (digests of the full weights, gathered here for checking only) and the
largest gather the source was asked for to <out>/result.json.

    python tests/helpers/sharded_publisher.py --rank R --mode fsdp|zero3 --dist-port P --ws-port Q \\
        --control-port C --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from helpers.wait import wait_until  # (the test puts tests/ on PYTHONPATH)
from sluice.config.weight_sync import WeightSyncConfig
from sluice.weight_sync.broadcaster import WeightBroadcaster
from sluice.weight_sync.probe import digest
from sluice.weight_sync.source import ModuleSource, ZeRO3Source

BUCKET_MB = 0.5  # every tensor (256x256 fp32 = 256 KiB) is smaller than a bucket


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])


def recording(source_cls):
    """The source, counting the elements materialized by each gather."""

    class Recording(source_cls):
        max_gather_numel = 0
        gathers = 0

        @contextmanager
        def gather(self, names):
            with super().gather(names) as full:
                numel = sum(t.numel() for t in full.values())
                Recording.max_gather_numel = max(Recording.max_gather_numel, numel)
                Recording.gathers += 1
                yield full

    return Recording


def full_weights(mode: str, module: torch.nn.Module, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """Every weight in full, for checking (the whole model at once: tests only)."""
    if mode == "fsdp":
        return [(n, p.full_tensor().to(dtype)) for n, p in module.named_parameters()]
    import deepspeed

    params = list(module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
        return [(n, p.data.clone().to(dtype)) for n, p in params]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--mode", choices=["fsdp", "zero3"], required=True)
    ap.add_argument("--dist-port", type=int, required=True)
    ap.add_argument("--ws-port", type=int, required=True)
    ap.add_argument("--control-port", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(args.dist_port),
        RANK=str(args.rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(args.rank),
        LOCAL_WORLD_SIZE="2",
    )
    torch.set_num_threads(1)
    wire = torch.float32 if args.mode == "fsdp" else torch.bfloat16
    model = build_model()
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))
    if args.mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (2,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        module = model
        source = recording(ModuleSource)(model)

        def train_step() -> None:
            model(x).square().mean().backward()
            optimizer.step()
    else:
        import deepspeed

        from sluice.learner.dist import skip_inference_shm_op

        skip_inference_shm_op()  # (as the learner does on CPU: no JIT build of an inference op)
        deepspeed.init_distributed(dist_backend="gloo")
        config = {
            "train_batch_size": 2,
            "zero_optimization": {"stage": 3},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        }
        engine, _, _, _ = deepspeed.initialize(
            model=model, config=config, model_parameters=model.parameters()
        )
        module = engine.module
        source = recording(ZeRO3Source)(engine)

        def train_step() -> None:
            engine.backward(engine(x).square().mean())
            engine.step()

    cfg = WeightSyncConfig(
        master_port=args.ws_port,
        bucket_mb=BUCKET_MB,
        dtype="float32" if wire == torch.float32 else "bfloat16",
        timeout_s=60,
        publish_timeout_s=60,
        ready_timeout_s=10,
        send="inline",  # the stats of each publish are checked right after it
    )
    broadcaster = WeightBroadcaster(cfg, torch.device("cpu"), learner_rank=args.rank)
    control = None
    if args.rank == 0:
        import zmq

        from sluice.control.admission import AdmissionPolicy
        from sluice.control.server import ControlServer

        control = ControlServer(
            f"tcp://127.0.0.1:{args.control_port}", AdmissionPolicy(8, 1), ctx=zmq.Context()
        )
        control.attach_membership(broadcaster.membership)
        control.start()
        broadcaster.start()
        # the receiver joins the first epoch
        wait_until(lambda: broadcaster.membership.registered() >= 1, 60, "a receiver joined")
    dist.barrier()
    digests = {}
    for version in (1, 2):
        stats = broadcaster.publish(version, source)
        digests[version] = digest(full_weights(args.mode, module, wire))
        if args.rank == 0:
            assert stats.members == 1 and stats.delivered, stats
        train_step()
    if args.rank == 0:
        itemsize = torch.empty((), dtype=wire).element_size()
        result = {
            "digests": digests,
            "max_gather_numel": type(source).max_gather_numel,
            "gathers": type(source).gathers,
            "buckets": len(broadcaster._layout),
            "bucket_numel": int(BUCKET_MB * 2**20) // itemsize,
            "model_numel": sum(spec.numel for spec in source.specs()),
        }
        (args.out / "result.json").write_text(json.dumps(result))
        broadcaster.close()
        control.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
