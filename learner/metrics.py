"""Learner metrics: JSONL (the run record), TensorBoard scalars, and a Prometheus endpoint."""

from __future__ import annotations

from typing import Any

from prometheus_client import Gauge

from sluice.config.run import RunConfig
from sluice.metrics import JsonlLog, PrometheusEndpoint, record_endpoint

# Exported as Prometheus gauges sluice_learner_<name>.
PROM_GAUGES = {
    "version": "Policy version (optimizer steps published)",
    "reward_mean": "Mean reward of the last batch",
    "loss": "Policy loss of the last step",
    "staleness_mean": "Mean version lag of the last batch",
    "staleness_max": "Max version lag of the last batch",
    "samples_per_s": "Trajectories trained per second (last step)",
    "wait_frac": "Fraction of the last step spent waiting for data",
    "total_dropped_stale": "Samples dropped by the buffer for staleness (total)",
    "total_violations": "Samples that reached the learner beyond the staleness bound (total)",
}


class LearnerMetrics:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.log = JsonlLog(cfg.run_dir / "metrics" / "learner.jsonl")
        self.prom = PrometheusEndpoint(cfg.metrics.prometheus_host, cfg.metrics.port("learner"))
        self.gauges = {
            k: Gauge(f"sluice_learner_{k}", h, registry=self.prom.registry) for k, h in PROM_GAUGES.items()
        }
        self.tb = None
        if cfg.metrics.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(cfg.run_dir / "tb"))

    def start(self) -> None:
        port = self.prom.start()
        record_endpoint(self.cfg.run_dir, "learner", metrics_port=port)

    def step(self, version: int, values: dict[str, Any]) -> None:
        record = {"version": version, **values}
        if version % self.cfg.learner.log_every == 0:
            self.log.write(record)
        self.gauges["version"].set(version)
        for k, g in self.gauges.items():
            if k in values:
                g.set(values[k])
        if self.tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(f"learner/{k}", v, version)

    def close(self) -> None:
        self.log.close()
        self.prom.stop()
        if self.tb is not None:
            self.tb.close()
