"""Buffer stores, one per `buffer.mode`, and the factory that builds the one a shard runs
(docs/architecture.md, Buffer). The base class (`base.py`) knows none of them."""

from __future__ import annotations

from sluice.buffer.stores.base import ShardStore, StoreCounters
from sluice.buffer.stores.fifo import FifoStore
from sluice.buffer.stores.replay import ReplayStore
from sluice.config.buffer import BufferConfig

__all__ = ["FifoStore", "ReplayStore", "ShardStore", "Store", "StoreCounters", "build_store"]

Store = FifoStore | ReplayStore  # (a union, so `store.mode == "fifo"` tells a type checker which)


def build_store(cfg: BufferConfig) -> Store:
    """The store of `cfg.mode`, with the limits of `cfg`."""
    common = dict(
        capacity=cfg.capacity,
        capacity_bytes=cfg.capacity_bytes,
        dedupe_window=cfg.dedupe_window,
        max_policies=cfg.max_policies,
    )
    if cfg.mode == "fifo":
        return FifoStore(lease_timeout_s=cfg.lease_timeout_s, **common)
    return ReplayStore(replay=cfg.replay, **common)
