"""The broadcast group between the learner and rollout services.

A stateless torch.distributed process group (not the default group: a learner already has its
own DDP/ZeRO group, and rollout processes have none), built over a TCPStore served by learner
rank 0. The backend follows the device: nccl on CUDA, hccl on Ascend (torch_npu), gloo on CPU;
everything above this module is the same code for all three.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend != "auto":
        return backend
    return {"cuda": "nccl", "npu": "hccl"}.get(device.type, "gloo")


def open_store(host: str, port: int, world_size: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """Rank 0 serves the store; the others connect to it, retrying until `timeout_s`."""
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=is_master,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


@dataclass
class BroadcastGroup:
    """Rank 0 is the learner (the source); ranks 1..world_size-1 are receivers."""

    pg: dist.ProcessGroup
    rank: int
    world_size: int
    backend: str

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()


def make_group(
    backend: str,
    store: dist.Store,
    rank: int,
    world_size: int,
    timeout_s: float,
    prefix: str = "weights/epoch0/",
) -> BroadcastGroup:
    """Join the group (blocks until all world_size ranks have joined or `timeout_s` passes)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    scoped = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(scoped, rank, world_size, timeout)
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(scoped, rank, world_size, opts)
    elif backend == "hccl":
        try:
            import torch_npu  # noqa: F401  (registers the hccl backend)
            from torch_npu._C._distributed_c10d import ProcessGroupHCCL
        except ImportError as e:
            raise RuntimeError("weight_sync.backend=hccl needs torch_npu (Ascend)") from e
        opts = ProcessGroupHCCL.Options()
        opts._timeout = timeout
        pg = ProcessGroupHCCL(scoped, rank, world_size, opts)
    else:
        raise ValueError(f"weight_sync.backend={backend!r}: expected gloo, nccl or hccl")
    return BroadcastGroup(pg=pg, rank=rank, world_size=world_size, backend=backend)
