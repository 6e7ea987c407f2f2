"""Learner side of weight sync: announce a version, then broadcast it bucket by bucket.

Rules:
- Learner rank 0 serves the rendezvous TCPStore and is rank 0 (the source) of the group.
- Publish `seq` writes the msgpack Announcement under key `announce/<seq>` in the store, then
  broadcasts the buckets in layout order. Receivers read the key first, so they know what to
  allocate and what checksums to expect; the store never loses a key to a slow joiner.
- The announcement of `seq - 1` is deleted once `seq` is announced: by then every receiver
  has completed the collectives of `seq - 1`, so it has read the key.
- `close()` announces `shutdown`, so receivers leave their loop instead of timing out.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import msgspec
import torch

from sluice.config.weight_sync import WeightSyncConfig
from weight_sync.group import BroadcastGroup, make_group, open_store, resolve_backend
from weight_sync.layout import (
    TORCH_DTYPES,
    Announcement,
    Bucket,
    checksum,
    describe,
    pack_bucket,
    plan_buckets,
)

log = logging.getLogger(__name__)


@dataclass
class PublishStats:
    version: int
    bytes: int
    seconds: float


class WeightBroadcaster:
    def __init__(
        self,
        cfg: WeightSyncConfig,
        n_receivers: int,
        device: torch.device,
        dtype: str = "float32",
    ) -> None:
        self.cfg = cfg
        self.n_receivers = n_receivers
        self.device = device
        self.cast_to = TORCH_DTYPES[dtype]
        self.backend = resolve_backend(cfg.backend, device)
        self.store = None
        self.group: BroadcastGroup | None = None
        self._buckets: list[Bucket] | None = None
        self._seq = 0
        self._encoder = msgspec.msgpack.Encoder()

    def start(self) -> None:
        """Serve the store and form the group (blocks until every receiver joined)."""
        world = self.n_receivers + 1
        self.store = open_store(self.cfg.master_addr, self.cfg.master_port, world, True, self.cfg.timeout_s)
        if self.n_receivers == 0:
            return
        log.info("weight sync: waiting for %d receivers (%s)", self.n_receivers, self.backend)
        self.group = make_group(self.backend, self.store, 0, world, self.cfg.timeout_s)
        log.info("weight sync: group of %d formed", world)

    def publish(self, version: int, model: torch.nn.Module) -> PublishStats:
        t0 = time.perf_counter()
        params = dict(model.named_parameters())
        if self._buckets is None:
            self._buckets = plan_buckets(
                params.items(), int(self.cfg.bucket_mb * 2**20), cast_to=self.cast_to
            )
            log.info("weight sync layout: %s", describe(self._buckets))
        flats = [pack_bucket(b, params, self.device) for b in self._buckets]
        announcement = Announcement(
            kind="weights",
            version=version,
            buckets=self._buckets,
            checksums=[checksum(f) for f in flats],
        )
        self._announce(announcement)
        if self.group is not None:
            for flat in flats:
                self.group.broadcast(flat, src=0)
        nbytes = sum(f.numel() * f.element_size() for f in flats)
        return PublishStats(version, nbytes, time.perf_counter() - t0)

    def close(self) -> None:
        if self.store is not None:
            self._announce(Announcement(kind="shutdown"))
            # Give receivers a moment to read the key before the store goes away with us.
            time.sleep(0.5)
        self.group = None
        self.store = None

    def _announce(self, announcement: Announcement) -> None:
        assert self.store is not None, "start() first"
        self.store.set(f"announce/{self._seq}", self._encoder.encode(announcement))
        if self._seq > 0:
            self.store.delete_key(f"announce/{self._seq - 1}")
        self._seq += 1
