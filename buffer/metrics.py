"""Prometheus metrics of one shard (updated by the shard's own loop, read by scrapes)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

GAUGES = {
    "held": "Trajectories held (fifo: queued + leased; replay: stored)",
    "held_bytes": "Payload bytes held",
    "queued": "fifo: trajectories waiting to be leased",
    "queued_bytes": "fifo: payload bytes waiting to be leased",
    "leased": "fifo: trajectories under a lease",
    "capacity": "Capacity in trajectories",
    "put": "Trajectories accepted by PUT (total)",
    "duplicates": "Trajectories dropped as duplicates (total)",
    "delivered": "fifo: trajectories leased by GET (total, redeliveries included)",
    "acked": "fifo: trajectories deleted by ACK (total)",
    "redelivered": "fifo: trajectories returned to the queue by NACK or lease expiry (total)",
    "dropped_stale": "Trajectories dropped for being older than the staleness bound (total)",
    "refused_full": "Trajectories refused because the shard was full (total)",
    "evicted": "replay: trajectories evicted from the ring (total)",
    "sampled": "replay: groups drawn by SAMPLE (total)",
    "priority_updates": "replay: priorities set by PRIORITY (total)",
    "dedupe_ids": "traj_ids remembered for dedupe",
    "log_bytes": "Bytes in the shard's log segments",
    "log_segments": "Segment files of the shard's log",
    "fsyncs": "fsync calls on the log (total)",
    "compactions": "Log compactions finished (total)",
    "compaction_errors": "Log compactions that failed (total)",
    "log_write_errors": "Log writes that failed (total)",
    "log_recycled": "Log segments written into a reused (retired) segment file (total)",
    "same_host": "1 if this shard shares its segment files with clients on its host",
    "region_puts": "PUTs whose payload a same-host producer wrote into the segments (total)",
    "region_bytes": "Payload bytes same-host producers wrote into the segments themselves (total)",
    "compacted_bytes": "Bytes written by compactions (snapshot segments) (total)",
    "region_copies": "Same-host PUTs copied because their segment had been closed meanwhile (total)",
    "refs_served": "Trajectories delivered by reference to same-host consumers (total)",
    "reservations": "Segment space reserved by same-host producers, not yet PUT",
    "reserved_bytes": "Bytes of those reservations",
    "reservations_expired": "Reservations abandoned after reserve_timeout_s (total)",
    "retiring_segments": "Segments out of the log that readers may still map (not reused yet)",
    "pinned_segments": "Segments that leases or recent samples may still read",
}


class ShardMetrics:
    def __init__(self, registry: CollectorRegistry, shard: int) -> None:
        labels = {"shard": str(shard)}
        self.gauges = {
            name: Gauge(f"sluice_buffer_{name}", help_, registry=registry, labelnames=["shard"]).labels(
                **labels
            )
            for name, help_ in GAUGES.items()
        }
        self.errors = Counter(
            "sluice_buffer_errors", "Error replies by code", registry=registry, labelnames=["code"]
        )

    def update(self, stats: dict[str, int]) -> None:
        for name, gauge in self.gauges.items():
            if name in stats:
                gauge.set(stats[name])
