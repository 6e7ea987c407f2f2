"""Learner metrics: JSONL (the run record), TensorBoard scalars, and a Prometheus endpoint.

Rank 0 of each learner group writes `metrics/learner[-<policy>].jsonl` and TensorBoard; every
rank serves Prometheus. On resume from version c the JSONL keeps its lines up to c (later
lines belong to a lineage that was lost) and TensorBoard purges steps after c, so the
metrics continue where the checkpoint did. JSONL lines and TensorBoard scalars are written by
a thread of their own: building ~35 TensorBoard events took ~8% of a tiny model's step. It
wakes every WRITE_EVERY_S and writes what the steps queued since, not once a step: each of its
wake-ups and writes was a hand-over of the GIL the training thread then waited to take back
(docs/architecture.md, "Cores and threads").
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from prometheus_client import Gauge, Histogram

from sluice.config.policy import learner_role, role_suffix
from sluice.config.run import RunConfig
from sluice.metrics import JsonlLog, PrometheusEndpoint, read_jsonl, record_endpoint
from sluice.tb_events import EventWriter

WRITE_EVERY_S = 0.25  # how often the writer wakes; `flush` and `close` wake it at once

# Exported as Prometheus gauges sluice_learner_<name>.
PROM_GAUGES = {
    "version": "Policy version (learner steps published)",
    "reward_mean": "Mean reward of the last batch",
    "loss": "Total loss of the last step",
    "policy_loss": "Policy term of the last step's loss",
    "value_loss": "Value term of the last step's loss",
    "clip_frac": "Share of tokens/steps where the PPO clip was active",
    "is_weight_mean": "Mean importance weight (behaviour correction)",
    "is_truncated_frac": "Share of importance weights cut at the cap",
    "staleness_mean": "Mean version lag of the last batch",
    "staleness_max": "Max version lag of the last batch",
    "samples_per_s": "Trajectories trained per second (last step)",
    "tokens_per_s": "Tokens (LLM) or env steps (classic) trained per second (last step)",
    "wait_frac": "Fraction of the last step spent waiting for data",
    "wait_s": "Seconds of the last step spent waiting for data",
    "compute_s": "Seconds of the last step spent computing",
    "compute_cpu_s": "CPU seconds of the training thread in compute_s (rest: waiting for the GIL or a core)",
    "compute_sleeps": "Times the training thread slept in compute_s (waiting to take the GIL back)",
    "fetch_gets": "GET calls that filled the last batch (1: it was waiting, whole, in the buffer)",
    "sync_s": "Seconds of the last step spent publishing weights",
    "forward_fill": "Share of the policy forward's positions holding a token (padding computed: the rest)",
    "inert_frac": "Share of the last step's tokens left out of its forward: rows without gradient",
    "episode_return_mean": "Mean return of the last return_window episodes (classic RL)",
    "total_dropped_stale": "Samples dropped by the buffer for staleness (total)",
    "total_violations": "Samples that reached the learner beyond the staleness bound (total)",
}


class LearnerMetrics:
    def __init__(self, cfg: RunConfig, policy_id: str, rank: int, resumed_at: int | None) -> None:
        self.cfg = cfg
        self.rank = rank
        self.role = learner_role(cfg, policy_id, rank)
        suffix = role_suffix(cfg, policy_id)
        self.prom = PrometheusEndpoint(cfg.metrics.prometheus_host, _port(cfg, policy_id, rank))
        reg = self.prom.registry
        self.gauges = {k: Gauge(f"sluice_learner_{k}", h, registry=reg) for k, h in PROM_GAUGES.items()}
        buckets = [float(k) for k in range(cfg.learner.max_staleness + 1)]
        self.staleness = Histogram(
            "sluice_learner_staleness", "Version lag of consumed samples", buckets=buckets, registry=reg
        )
        self.log = self.tb = None
        if rank == 0:
            path = cfg.run_dir / "metrics" / f"learner{suffix}.jsonl"
            if resumed_at is not None:
                _truncate_after(path, resumed_at)
            self.log = JsonlLog(path)
            if cfg.metrics.tensorboard:
                purge = resumed_at + 1 if resumed_at is not None else None
                self.tb = EventWriter(cfg.run_dir / f"tb{suffix}", purge_step=purge)
        self._records: queue.Queue[tuple[int, dict[str, Any]] | None] = queue.Queue()
        self._wake = threading.Event()
        self._writer = threading.Thread(target=self._write_loop, name="learner-metrics", daemon=True)
        if rank == 0:
            self._writer.start()

    def start(self) -> None:
        record_endpoint(self.cfg.run_dir, self.role, metrics_port=self.prom.start())

    def observe_staleness(self, lags: list[int]) -> None:
        for lag in lags:
            self.staleness.observe(lag)

    def step(self, version: int, values: dict[str, Any]) -> None:
        self.gauges["version"].set(version)
        for k, g in self.gauges.items():
            if isinstance(values.get(k), (int, float)):
                g.set(values[k])
        if self.rank == 0:
            self._records.put((version, {"time": time.time(), "version": version, **values}))

    def _write_loop(self) -> None:
        if self.log is None:
            raise RuntimeError("the metrics writer runs on rank 0 only (the rank with the log)")
        closing = False
        while not closing:
            self._wake.wait(WRITE_EVERY_S)
            self._wake.clear()
            items = _drain(self._records)
            closing = None in items
            try:
                self._write([item for item in items if item is not None])
            finally:
                for _ in items:
                    self._records.task_done()

    def _write(self, items: list[tuple[int, dict[str, Any]]]) -> None:
        assert self.log is not None
        self.log.write_many(
            [record for version, record in items if version % self.cfg.learner.log_every == 0]
        )
        if self.tb is None:
            return
        for version, record in items:
            scalars = {
                f"learner/{k}": v
                for k, v in record.items()
                if isinstance(v, (int, float)) and k not in ("time", "version")
            }
            for lag, count in enumerate(record.get("staleness_hist", [])):
                scalars[f"staleness/lag_{lag}"] = count
            # One event with every scalar of the step, framed with a native CRC: this thread
            # shares the GIL with the training thread, and 35 add_scalar calls cost ~1 ms of
            # Python a step against ~0.1 ms (sluice/tb_events.py; docs/architecture.md).
            self.tb.add_scalars(scalars, version)

    def flush(self) -> None:
        """Until every step recorded so far is written. Called before a checkpoint: a learner
        killed between saving one and writing its steps' lines resumed past a version the
        log never got (measured: version 30 missing after a kill -9 right after step 30)."""
        if self._writer.is_alive():
            self._wake.set()
            self._records.join()

    def close(self) -> None:
        if self._writer.is_alive():
            self._records.put(None)  # written to the end before the files close
            self._wake.set()
            self._writer.join()
        if self.log is not None:
            self.log.close()
        self.prom.stop()
        if self.tb is not None:
            self.tb.close()


def _drain(q: queue.Queue) -> list:
    """Every item queued now, oldest first."""
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items


def _port(cfg: RunConfig, policy_id: str, rank: int) -> int:
    if cfg.metrics.base_port == 0:
        return 0
    return cfg.metrics.port("learner", cfg.learner.policies.index(policy_id) * 10 + rank)


def _truncate_after(path: Path, version: int) -> None:
    """Keep the lines of steps <= version (atomically)."""
    if not path.is_file():
        return
    kept = [r for r in read_jsonl(path) if r.get("version", 0) <= version]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)
