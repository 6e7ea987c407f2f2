"""Rollout side of weight sync: a thread that takes part in every broadcast.

Rules:
- Group rank = 1 + rollout index; the thread joins the group at start and then follows the
  announcement sequence `announce/0, 1, 2, ...` in the learner's store.
- Data lands in fresh buckets, never in the live model: generation goes on meanwhile. After
  every bucket of a version passed its checksum, the version becomes `latest`; the rollout
  loop takes it at a safe point and loads it into its engine in place.
- A bucket whose checksum does not match makes the whole version refused: the old weights
  stay, the error is counted and logged, and the next version is awaited.
- A `shutdown` announcement ends the thread; any other failure (learner gone, collective
  timeout) is kept in `error` and ends the thread: the rollout loop checks it and stops loudly.
"""

from __future__ import annotations

import datetime
import logging
import threading
from dataclasses import dataclass

import msgspec
import torch

from sluice.config.weight_sync import WeightSyncConfig
from weight_sync.group import make_group, open_store, resolve_backend
from weight_sync.layout import Announcement, checksum, empty_bucket, unpack_bucket

log = logging.getLogger(__name__)


@dataclass
class ReceivedWeights:
    version: int
    tensors: list[tuple[str, torch.Tensor]]  # named views into the received buckets


class WeightReceiver:
    def __init__(self, cfg: WeightSyncConfig, rank: int, world_size: int, device: torch.device) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.backend = resolve_backend(cfg.backend, device)
        self.error: BaseException | None = None
        self.refused_versions = 0
        self.finished = threading.Event()  # shutdown announced, or failed
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._latest: ReceivedWeights | None = None
        self._arrived = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name="weight-receiver", daemon=True)
        self._decoder = msgspec.msgpack.Decoder(Announcement)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def take_latest(self) -> ReceivedWeights | None:
        """The newest verified version not yet taken (older untaken ones are skipped)."""
        with self._lock:
            latest, self._latest = self._latest, None
            return latest

    def wait_for_weights(self, timeout_s: float) -> ReceivedWeights | None:
        with self._arrived:
            self._arrived.wait_for(
                lambda: self._latest is not None or self.finished.is_set(), timeout=timeout_s
            )
            latest, self._latest = self._latest, None
            return latest

    # -- thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            store = open_store(
                self.cfg.master_addr, self.cfg.master_port, self.world_size, False, self.cfg.timeout_s
            )
            group = make_group(self.backend, store, self.rank, self.world_size, self.cfg.timeout_s)
            seq = 0
            while not self._stop.is_set():
                announcement = self._next_announcement(store, seq)
                if announcement is None or announcement.kind == "shutdown":
                    break
                seq += 1
                flats = []
                for bucket in announcement.buckets:
                    flat = empty_bucket(bucket, self.device)
                    group.broadcast(flat, src=0)
                    flats.append(flat)
                bad = [i for i, (f, c) in enumerate(zip(flats, announcement.checksums)) if checksum(f) != c]
                if bad or len(announcement.checksums) != len(flats):
                    self.refused_versions += 1
                    log.error(
                        "weight sync: version %d refused, checksum mismatch in buckets %s; "
                        "keeping the current weights",
                        announcement.version,
                        bad,
                    )
                    continue
                tensors = [t for b, f in zip(announcement.buckets, flats) for t in unpack_bucket(b, f)]
                with self._arrived:
                    self._latest = ReceivedWeights(announcement.version, tensors)
                    self._arrived.notify_all()
        except BaseException as e:  # noqa: BLE001 - surfaced to the rollout loop via .error
            if not self._stop.is_set():
                log.exception("weight receiver failed")
                self.error = e
        finally:
            with self._arrived:
                self.finished.set()
                self._arrived.notify_all()

    def _next_announcement(self, store, seq: int) -> Announcement | None:
        key = f"announce/{seq}"
        while not self._stop.is_set():
            try:
                store.wait([key], datetime.timedelta(seconds=1))
            except torch.distributed.DistStoreError:
                continue  # "wait timeout": not announced yet. DistNetworkError (learner gone) propagates.
            return self._decoder.decode(store.get(key))
        return None
