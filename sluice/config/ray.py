"""Placing the roles on a Ray cluster (`sluice ray CONFIG`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sluice.config.base import Section


class RoleResources(Section):
    num_cpus: float = Field(default=1.0, gt=0)
    """CPUs Ray reserves for each process of this role."""
    num_gpus: float = Field(default=0.0, ge=0)
    """GPUs Ray reserves (and makes visible through CUDA_VISIBLE_DEVICES) for each process."""
    resources: dict[str, float] = {}
    """Other Ray resources per process, e.g. {NPU: 1} for an Ascend NPU (Ray sets
    ASCEND_RT_VISIBLE_DEVICES) or a custom node label resource."""


class RayConfig(Section):
    address: str | None = None
    """Cluster to join: "auto" (the cluster this node belongs to, as after `ray up` or `ray
    start`), "ray://head:10001" (Ray Client), or None to start a local Ray instance (a new one,
    even where a cluster already runs on this machine or RAY_ADDRESS names one)."""
    local_num_cpus: int | None = Field(default=None, ge=1)
    """CPUs of the local instance when address is None (None: every core of this machine)."""
    namespace: str = "sluice"
    """Ray namespace of the run's actors."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Placement-group strategy over the bundles of every role: PACK fills nodes one by one,
    SPREAD puts roles on different nodes where it can."""
    buffer: RoleResources = RoleResources()
    """Resources of each buffer shard."""
    learner: RoleResources = RoleResources()
    """Resources of each learner rank."""
    rollout: RoleResources = RoleResources()
    """Resources of each rollout service."""
    ready_timeout_s: float = Field(default=600.0, gt=0)
    """How long to wait for the cluster to grant the placement group."""
    env: dict[str, str] = {}
    """Environment variables of every role process (e.g. NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME)."""
