"""How new weights travel from the learner to rollout services."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sluice.config.base import Section


class WeightSyncConfig(Section):
    backend: Literal["auto", "gloo", "nccl", "hccl"] = "auto"
    """torch.distributed backend of the broadcast group: auto = nccl on CUDA, hccl on Ascend,
    gloo on CPU."""
    every: int = Field(1, ge=1)
    """Publish weights after every k optimizer steps."""
    bucket_mb: float = Field(64.0, gt=0)
    """Parameters are flattened by dtype into buckets of about this many MiB."""
    master_addr: str = "127.0.0.1"
    """Host of the rendezvous store (served by learner rank 0)."""
    master_port: int = Field(0, ge=0, le=65535)
    """Port of the rendezvous store. 0: the local launcher picks a free port."""
    timeout_s: float = Field(300.0, gt=0)
    """Collective timeout: a receiver that does not take part within this is an error."""
