"""Prometheus metrics of the learner's weight publishing (sluice_weight_sync_*), registered in
the registry of the role that owns the broadcaster (no global registry)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge


@dataclass
class PublishStats:
    version: int
    bytes: int  # bytes broadcast (0 without members; a delta counts only what changed)
    seconds: float  # the whole publish: gather, pack, checksums, announcement, broadcast
    members: int  # group members the version was broadcast to
    epoch: int
    delta_tensors: int = -1  # tensors a delta carried; -1: a full version
    retried: bool = False  # the first attempt failed; the version went out over a rebuilt group
    delivered: bool = True  # False: the retry failed too (members get the next version)
    # where the (last attempt's) time went: announcement to our side of the last broadcast done
    # (packing and sending overlap in there), then to every member's verified report
    send_seconds: float = 0.0
    confirm_seconds: float = 0.0
    # `send: background`: returned once packed; the sends, the confirmation and the stats of
    # what was delivered follow in the confirmation thread (BroadcastMetrics records them)
    pending: bool = False

    def as_record(self) -> dict[str, float]:
        return {
            "ws_bytes": float(self.bytes),
            "ws_seconds": self.seconds,
            "ws_gbps": self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0,
            "ws_members": float(self.members),
            "ws_epoch": float(self.epoch),
            "ws_send_seconds": self.send_seconds,
            "ws_confirm_seconds": self.confirm_seconds,
        }


class BroadcastMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.enabled = registry is not None
        if registry is None:
            return
        self.publishes = Counter("sluice_weight_sync_publishes", "Versions published", registry=registry)
        self.bytes = Counter("sluice_weight_sync_bytes", "Bytes broadcast", registry=registry)
        self.seconds = Gauge("sluice_weight_sync_publish_seconds", "Last publish duration", registry=registry)
        self.phase_seconds = Gauge(
            "sluice_weight_sync_phase_seconds",
            "Last publish: send (pack and broadcast) and confirm (until every member verified)",
            ["phase"],
            registry=registry,
        )
        self.members = Gauge(
            "sluice_weight_sync_members", "Members of the broadcast group", registry=registry
        )
        self.epoch = Gauge("sluice_weight_sync_epoch", "Membership epoch", registry=registry)
        self.failures = Counter(
            "sluice_weight_sync_failures", "Publishes whose collective failed", registry=registry
        )
        self.refused = Counter(
            "sluice_weight_sync_refused",
            "Versions refused by receivers (checksum, layout)",
            registry=registry,
        )
        self.receiver_failures = Counter(
            "sluice_weight_sync_receiver_failures", "Collectives that failed on a receiver", registry=registry
        )

    def published(self, stats: PublishStats) -> None:
        if not self.enabled:
            return
        self.publishes.inc()
        self.bytes.inc(stats.bytes)
        self.seconds.set(stats.seconds)
        self.phase_seconds.labels("send").set(stats.send_seconds)
        self.phase_seconds.labels("confirm").set(stats.confirm_seconds)
        self.members.set(stats.members)
        self.epoch.set(stats.epoch)

    def failed(self) -> None:
        if self.enabled:
            self.failures.inc()

    def reported(self, outcome: str) -> None:
        if not self.enabled:
            return
        (self.refused if outcome == "refused" else self.receiver_failures).inc()
