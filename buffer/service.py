"""Entry point of one buffer shard process."""

from __future__ import annotations

import threading

from sluice.buffer.metrics import ShardMetrics
from sluice.buffer.server import ShardServer
from sluice.config.run import RunConfig
from sluice.launch.heap import freeze_startup_heap, retain_freed_memory
from sluice.launch.threads import apply_placement
from sluice.metrics import PrometheusEndpoint, record_endpoint
from sluice.security import secure_context


def run_buffer(cfg: RunConfig, shard: int, stop: threading.Event) -> int:
    if not 0 <= shard < cfg.buffer.shards:
        raise ValueError(f"--shard {shard}: buffer.shards is {cfg.buffer.shards}")
    apply_placement()  # `sluice run` on a CPU host: yields to the learner's training threads
    log_dir = cfg.buffer.shard_log_dir(shard, cfg.run_dir if cfg.run.dir is not None else None)
    prom = PrometheusEndpoint(cfg.metrics.prometheus_host, cfg.metrics.port("buffer", shard))
    metrics = ShardMetrics(prom.registry, shard)
    server = ShardServer(
        cfg.buffer, shard, log_dir=log_dir, metrics=metrics, ctx=secure_context(cfg.security, "server")
    )
    port = prom.start()
    if cfg.run.dir is not None:
        record_endpoint(cfg.run_dir, f"buffer-{shard}", metrics_port=port, endpoint=server.endpoint)
    freeze_startup_heap()  # built: later full collections walk only what serving makes
    retain_freed_memory()
    try:
        server.serve(stop)
    finally:
        prom.stop()
    return 0
