"""A stand-in learner for rollout tests and scale benchmarks (no model, no training).

It plays the learner's part on the two paths rollouts meet it on, with the real components:
it serves the control plane (admission control, heartbeats) and consumes from the real buffer
shards in batches of `batch_size` whole groups, ACKs them, and then advances and publishes its
version (versions only: sim services need no tensors). A `step_s` pause per step makes it a
slow learner. It measures what consumption sees: samples, staleness of every sample
(`version - sample.version`), samples dropped as stale, and which services delivered.

    python -m sluice.testing.drain CONFIG --out timeline.jsonl [--step-s 0.5] [--no-filter]

`--no-filter` consumes with min_version 0 (no consumer-side filter), so the staleness it
records is what admission control alone achieved.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from sluice.buffer.client import BufferClient, LeasedBatch
from sluice.config.loader import load_config
from sluice.config.run import RunConfig
from sluice.control.admission import AdmissionPolicy
from sluice.control.server import ControlServer, samples_by_service
from sluice.metrics import JsonlLog
from sluice.net import raise_fd_limit

log = logging.getLogger(__name__)


@dataclass
class DrainStats:
    version: int = 0
    consumed: int = 0
    dropped_stale: int = 0
    staleness_max: int = 0
    staleness_hist: dict[int, int] = field(default_factory=dict)
    per_service: dict[str, int] = field(default_factory=dict)  # samples by service incarnation


class Drain:
    def __init__(self, cfg: RunConfig, *, step_s: float = 0.0, filter_stale: bool = True) -> None:
        lc = cfg.learner
        self.cfg = cfg
        self.step_s = step_s
        self.filter_stale = filter_stale
        self.control = ControlServer(
            cfg.control.bind_endpoint,
            AdmissionPolicy(lc.batch_size, lc.max_staleness),
            service_timeout_s=cfg.control.service_timeout_s,
        )
        self.buffer = BufferClient(cfg.buffer.all_endpoints())
        self.stats = DrainStats()
        self._lock = threading.Lock()

    def snapshot(self) -> DrainStats:
        with self._lock:
            s = self.stats
            return DrainStats(
                s.version,
                s.consumed,
                s.dropped_stale,
                s.staleness_max,
                dict(s.staleness_hist),
                dict(s.per_service),
            )

    def receive(self, stop: threading.Event) -> LeasedBatch | None:
        lc = self.cfg.learner
        min_version = self.stats.version - lc.max_staleness if self.filter_stale else 0
        batch = LeasedBatch()
        while len(batch.trajs) < lc.batch_size:
            if stop.is_set():
                if batch.leases:
                    self.buffer.nack(batch)
                return None
            batch.extend(
                self.buffer.get(lc.batch_size - len(batch.trajs), min_version=min_version, wait_ms=100)
            )
        return batch

    def step(self, batch: LeasedBatch) -> None:
        v = self.stats.version
        by_service = samples_by_service(batch.trajs)
        with self._lock:
            s = self.stats
            for t in batch.trajs:
                age = v - t.version
                s.staleness_hist[age] = s.staleness_hist.get(age, 0) + 1
                s.staleness_max = max(s.staleness_max, age)
            for service, n in by_service.items():
                s.per_service[service] = s.per_service.get(service, 0) + n
            s.consumed += len(batch.trajs)
            s.dropped_stale += batch.dropped_stale
        self.buffer.ack(batch)
        self.control.release(batch.dropped_stale)
        # as the learner does: what reached it per incarnation, credited to a service that dies
        self.control.seen(by_service)
        if self.step_s:
            time.sleep(self.step_s)
        with self._lock:
            self.stats.version = v + 1
        self.control.set_published(v + 1)
        self.control.set_version(v + 1)

    def run(self, stop: threading.Event, timeline: JsonlLog | None = None) -> DrainStats:
        self.control.start()
        while not stop.is_set():
            batch = self.receive(stop)
            if batch is None:
                break
            self.step(batch)
            if timeline is not None:
                s = self.snapshot()
                timeline.write(
                    {"version": s.version, "consumed": s.consumed, "dropped_stale": s.dropped_stale,
                     "staleness_max": s.staleness_max, "services": len(s.per_service)}
                )  # fmt: skip
        return self.snapshot()

    def close(self) -> None:
        self.control.close()
        self.buffer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("config")
    parser.add_argument("--out", required=True, help="timeline JSONL, one line per step")
    parser.add_argument("--step-s", type=float, default=0.0, help="pause per step (a slow learner)")
    parser.add_argument("--no-filter", action="store_true", help="consume with min_version 0")
    args = parser.parse_args()
    logging.basicConfig(level="INFO", format="%(asctime)s drain %(levelname)s %(message)s")
    raise_fd_limit()  # a control server with a thousand clients
    cfg = load_config(args.config)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    drain = Drain(cfg, step_s=args.step_s, filter_stale=not args.no_filter)
    timeline = JsonlLog(Path(args.out))
    try:
        drain.run(stop, timeline)
    finally:
        timeline.close()
        drain.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
