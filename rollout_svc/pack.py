"""A pack: many sim rollout services in one process (`sluice rollout --index I --count N`, or
`rollout.sim.services_per_process` for every launcher through the role plan).

A sim service sleeps the modelled decode time and imports no torch, so hundreds of them fit in
one interpreter. Each packed service is still a whole member of the run: its own index,
incarnation id, control-plane membership (heartbeats, admission, its quota), buffer PUTs and
metrics log; each runs the one actor loop (actor.py) in a thread of its own. What the services
of a pack share is the process's plumbing: one ZeroMQ context (its socket limit raised for
them), one Prometheus endpoint (every service's series, labelled `service`), and the raised
limit on open files. docs/architecture.md, "Packed sim services", tells why and what it costs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import zmq
from prometheus_client import CollectorRegistry, Metric

from sluice.config.loader import ConfigError
from sluice.config.rollout import rollout_service_id
from sluice.config.run import RunConfig
from sluice.metrics import PrometheusEndpoint
from sluice.net import raise_fd_limit
from sluice.rollout_svc.actor import ActorLoop, run_actor
from sluice.security import secure_context

log = logging.getLogger(__name__)

# ZeroMQ sockets one packed service opens: per buffer shard a DEALER and its monitor pair (two
# sockets), the control client and the heartbeat's; the context's default cap is 1023 sockets.
SOCKETS_PER_SHARD, SOCKETS_PER_SERVICE = 3, 4


def check_packable(cfg: RunConfig, count: int) -> None:
    """Only sim LLM services of one policy are packed: the others load a model (torch) each."""
    if count < 1:
        raise ConfigError(f"config error: --count {count}: must be >= 1")
    if count == 1:
        return
    if cfg.rollout.kind != "llm" or cfg.rollout.engine != "sim" or cfg.task.agents:
        raise ConfigError(
            "config error: --count > 1 packs sim services only (rollout.kind llm, rollout.engine "
            f"sim, no task.agents); got kind={cfg.rollout.kind}, engine={cfg.rollout.engine!r}"
        )


def pack_context(cfg: RunConfig, count: int) -> zmq.Context:
    """The ZeroMQ context every service of the pack shares, with room for their sockets."""
    ctx = secure_context(cfg.security, "client") or zmq.Context()
    needed = count * (SOCKETS_PER_SHARD * len(cfg.buffer.all_endpoints()) + SOCKETS_PER_SERVICE) + 64
    ctx.set(zmq.MAX_SOCKETS, max(int(ctx.get(zmq.MAX_SOCKETS)), needed))
    return ctx


class PackMetrics:
    """One Prometheus endpoint for the pack: each service's registry, its series labelled with
    the service's name (one HTTP server per process, not one per service)."""

    def __init__(self, cfg: RunConfig, first: int) -> None:
        self.registries: dict[str, CollectorRegistry] = {}
        self.endpoint = PrometheusEndpoint(cfg.metrics.prometheus_host, cfg.metrics.port("rollout", first))
        self.endpoint.registry.register(self)  # type: ignore[arg-type]  # a collector: collect()
        self.port = 0

    def start(self) -> int:
        self.port = self.endpoint.start()
        return self.port

    def for_service(self, name: str) -> PrometheusEndpoint:
        """What service `name` records into; its start() names the pack's port."""
        endpoint = PackedEndpoint(self)
        self.registries[name] = endpoint.registry
        return endpoint

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for name, registry in list(self.registries.items()):
            for metric in registry.collect():
                out = merged.setdefault(metric.name, Metric(metric.name, metric.documentation, metric.type))
                for s in metric.samples:
                    out.add_sample(s.name, {**s.labels, "service": name}, s.value, s.timestamp, s.exemplar)
        yield from merged.values()


class PackedEndpoint(PrometheusEndpoint):
    """A packed service's registry, served by the pack's endpoint (PackMetrics)."""

    def __init__(self, pack: PackMetrics) -> None:
        super().__init__(pack.endpoint.host, pack.port)
        self.pack = pack

    def start(self) -> int:
        return self.pack.port

    def stop(self) -> None:
        """The pack's endpoint outlives its services."""


def build_pack(cfg: RunConfig, first: int, count: int, stop: threading.Event) -> list[ActorLoop]:
    """Services first .. first+count-1, sharing one context and one metrics endpoint."""
    from sluice.rollout_svc.service import build_actor

    ctx = pack_context(cfg, count)
    metrics = PackMetrics(cfg, first)
    metrics.start()
    return [
        build_actor(cfg, i, stop, prom=metrics.for_service(rollout_service_id(i)), zmq_ctx=ctx)
        for i in range(first, first + count)
    ]


def run_pack(cfg: RunConfig, first: int, count: int, stop: threading.Event) -> int:
    """Run services first .. first+count-1 in this process, each in its own thread, until they
    end; the worst exit code. A service that fails ends alone: the others keep going."""
    check_packable(cfg, count)
    limit = raise_fd_limit()
    loops = build_pack(cfg, first, count, stop)
    log.info("pack of %d sim services (rollout-%d..%d), open-file limit %d",
             count, first, first + count - 1, limit)  # fmt: skip
    codes: dict[int, int] = {}

    def one(i: int, loop: ActorLoop) -> None:
        try:
            codes[i] = run_actor(loop)
        except Exception:  # one service's failure is its own; its log says why
            log.exception("rollout-%d failed", first + i)
            codes[i] = 1

    threads = [
        threading.Thread(target=one, args=(i, loop), name=rollout_service_id(first + i), daemon=True)
        for i, loop in enumerate(loops)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(codes.values(), default=1)
