"""Prometheus metrics of one shard (updated by the shard's own loop, read by scrapes)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class ShardMetrics:
    def __init__(self, registry: CollectorRegistry, shard: int) -> None:
        labels = {"shard": str(shard)}
        self.gauges = {
            name: Gauge(f"sluice_buffer_{name}", help_, registry=registry, labelnames=["shard"]).labels(
                **labels
            )
            for name, help_ in {
                "queued": "Trajectories waiting to be leased",
                "queued_bytes": "Payload bytes waiting to be leased",
                "leased": "Trajectories under a lease",
                "capacity": "Capacity in trajectories",
                "put": "Trajectories accepted by PUT (total)",
                "duplicates": "Trajectories dropped as duplicates (total)",
                "delivered": "Trajectories leased by GET (total, redeliveries included)",
                "acked": "Trajectories deleted by ACK (total)",
                "redelivered": "Trajectories returned to the queue by NACK or lease expiry (total)",
                "dropped_stale": "Trajectories dropped for being older than the staleness bound (total)",
                "refused_full": "Trajectories refused because the shard was full (total)",
            }.items()
        }
        self.errors = Counter(
            "sluice_buffer_errors", "Error replies by code", registry=registry, labelnames=["code"]
        )

    def update(self, stats: dict[str, int]) -> None:
        for name, gauge in self.gauges.items():
            if name in stats:
                gauge.set(stats[name])
