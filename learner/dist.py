"""The learner group: K processes in one torch.distributed process group.

Started with torchrun semantics: every rank reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR
and MASTER_PORT from its environment (the local launcher sets them; under torchrun they are
already set). WORLD_SIZE unset means a group of one: no process group at all.

Two groups: the default group (nccl on CUDA, hccl on Ascend, gloo on CPU) carries gradients;
a gloo group carries the CPU-side traffic (batches scattered by rank 0, stop flags, stats), so
that traffic never needs device copies. On CPU both are the same gloo group.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sluice.config.learner import LearnerConfig


def resolve_dist_backend(name: str, device: torch.device) -> str:
    if name != "auto":
        return name
    return {"cuda": "nccl", "npu": "hccl"}.get(device.type, "gloo")


@dataclass
class DistContext:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    cpu_group: Any = None  # gloo group for CPU tensors (None when world == 1)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place over all ranks (CPU tensors travel on the gloo group); returns the tensor."""
        if self.distributed:
            red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
            group = self.cpu_group if tensor.device.type == "cpu" else None
            dist.all_reduce(tensor, op=red, group=group)
        return tensor

    def broadcast_ints(self, values: list[int] | None, n: int) -> list[int]:
        """Rank 0's `n` integers on every rank."""
        if not self.distributed:
            assert values is not None
            return list(values)
        t = torch.tensor(values if self.is_main else [0] * n, dtype=torch.int64)
        dist.broadcast(t, src=0, group=self.cpu_group)
        return t.tolist()

    def scatter_bytes(self, parts: list[bytes] | None) -> bytes:
        """Rank 0 gives part r to rank r (parts are padded to one length for the collective)."""
        if not self.distributed:
            assert parts is not None
            return parts[0]
        if self.is_main and parts is None:
            raise ValueError("scatter_bytes: rank 0 must give the parts")
        mine = parts if self.is_main else None  # only rank 0's parts are sent
        sizes = self.broadcast_ints(None if mine is None else [len(p) for p in mine], self.world)
        width = max(max(sizes), 1)
        out = torch.empty(width, dtype=torch.uint8)
        chunks = None
        if mine is not None:
            chunks = []
            for p in mine:
                buf = torch.zeros(width, dtype=torch.uint8)
                if p:
                    buf[: len(p)] = torch.frombuffer(bytearray(p), dtype=torch.uint8)
                chunks.append(buf)
        dist.scatter(out, chunks, src=0, group=self.cpu_group)
        return out[: sizes[self.rank]].numpy().tobytes()

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.cpu_group)

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def init_dist(lc: LearnerConfig, device: torch.device) -> DistContext:
    """Join the learner group described by the environment (or by `lc` for address/port)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world == 1:
        return DistContext(0, 1, device)
    if world != lc.ranks:
        raise ValueError(f"WORLD_SIZE={world} but learner.ranks={lc.ranks}: they must agree")
    os.environ.setdefault("MASTER_ADDR", lc.master_addr)
    if "MASTER_PORT" not in os.environ:
        if lc.master_port == 0:
            raise ValueError("learner.master_port is 0 and MASTER_PORT is unset: no rendezvous address")
        os.environ["MASTER_PORT"] = str(lc.master_port)
    backend = resolve_dist_backend(lc.dist_backend, device)
    timeout = datetime.timedelta(seconds=lc.dist_timeout_s)
    if lc.backend == "deepspeed":
        import deepspeed

        if device.type == "cpu":
            skip_inference_shm_op()
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout, rank=rank, world_size=world)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    cpu_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return DistContext(rank, world, device, cpu_group)


def skip_inference_shm_op() -> None:
    """DeepSpeed's CPU comm backend JIT-compiles a shared-memory all-reduce op when it starts
    (`deepspeed_shm_comm`, used only by `inference_all_reduce`): ~50 s of C++ build in each new
    venv (its cache is keyed by the include paths), for an op training never calls. Marked not
    compatible (DeepSpeed keeps that dict for such edits), the backend starts without it."""
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


def pick_device(kind: str, local_rank: int = 0) -> torch.device:
    """`learner.device`: auto picks cuda, then npu, then cpu."""
    if kind == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank)
        if hasattr(torch, "npu") and torch.npu.is_available():  # type: ignore[attr-defined]
            return torch.device("npu", local_rank)
        return torch.device("cpu")
    return torch.device(kind, local_rank) if kind != "cpu" else torch.device("cpu")
