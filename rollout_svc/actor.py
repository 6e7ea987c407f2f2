"""The actor protocol, written once for every kind of rollout service.

A rollout service (LLM generation in `service.py`, gymnasium environments in `env_service.py`)
supplies only a `Producer`, "make one batch of trajectories with the weights you hold"; this
loop does the rest, the same for both: wait for the learner's first weights, ask admission
control how much may start (catching up to the published weights when asked), have the
producer make a batch, refund the quota it did not use, PUT the batch or refund it, and report
liveness and deliveries from a heartbeat thread so the control plane can give back the quota
of a service that dies. docs/architecture.md ("Rollout services") tells the story.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import zmq
from prometheus_client import Counter, Gauge

from sluice.buffer.client import BufferClient, PutAborted
from sluice.config.run import RunConfig
from sluice.control.client import ControlClient
from sluice.metrics import JsonlLog, PrometheusEndpoint, record_endpoint
from sluice.rollout_svc.engines.base import WeightUpdate
from sluice.rollout_svc.weights import WeightFeed
from sluice.rpc import RpcError
from sluice.security import secure_context
from sluice.trajectory import Trajectory

log = logging.getLogger(__name__)

PollWeights = Callable[[], "WeightUpdate | None"]


@dataclass
class Produced:
    """One batch a producer made, and what to log about it."""

    trajectories: list[Trajectory]
    record: dict[str, float | int | None]  # written with the batch to the service's metrics JSONL
    totals: dict[str, float] = field(default_factory=dict)  # added to the running totals heartbeats carry


class Producer(Protocol):
    """What a kind of rollout service supplies."""

    group_prefix: str  # set by the loop: the incarnation's id, which starts every group id it makes

    @property
    def version(self) -> int:
        """The version of the weights it acts with now."""
        ...

    def load_weights(self, update: WeightUpdate) -> None: ...

    def request(self) -> tuple[int, int]:
        """(samples wanted per batch, group size): what to ask admission for."""
        ...

    def produce(self, granted: int, poll_weights: PollWeights) -> Produced | None:
        """Make at most `granted` trajectories (None: nothing this time). `poll_weights` hands
        out newer weights for a producer that can take them in the middle of a batch."""
        ...

    def close(self) -> None: ...


@dataclass
class ActorConnections:
    """What one incarnation of a service talks to (`connect` builds it from the config)."""

    weights: WeightFeed
    buffer: BufferClient
    control: ControlClient
    prom: PrometheusEndpoint
    zmq_ctx: zmq.Context | None  # the secure ZeroMQ context, or None (plain sockets)


def connect(
    cfg: RunConfig,
    stop: threading.Event,
    prom: PrometheusEndpoint,
    weight_feed: Callable[[zmq.Context | None], WeightFeed],
) -> ActorConnections:
    """The buffer, control-plane and weight connections of one service; PUTs give up when the
    service stops or the learner has shut down."""
    zmq_ctx = secure_context(cfg.security, "client")  # None: plain sockets
    weights = weight_feed(zmq_ctx)
    buffer = BufferClient(
        cfg.buffer.all_endpoints(), should_abort=lambda: stop.is_set() or weights.done, ctx=zmq_ctx
    )
    control = ControlClient(cfg.control.endpoint, ctx=zmq_ctx, patience_s=cfg.control.learner_patience_s)
    return ActorConnections(weights, buffer, control, prom, zmq_ctx)


class ActorLoop:
    """Runs one rollout service: the protocol around a `Producer` (module docstring)."""

    def __init__(
        self,
        cfg: RunConfig,
        index: int,
        stop: threading.Event,
        producer: Producer,
        conn: ActorConnections,
        *,
        wait_for_published: bool,
    ) -> None:
        self.cfg = cfg
        self.stop = stop
        self.producer = producer
        self.weights = conn.weights
        self.buffer = conn.buffer
        self.control = conn.control
        self.prom = conn.prom
        self._zmq_ctx = conn.zmq_ctx
        self.wait_for_published = wait_for_published
        self.service_id = f"rollout-{index}"
        # Accounting identity on the control plane: a restarted service is a new incarnation.
        self.control_id = f"{self.service_id}.{uuid.uuid4().hex[:8]}"
        producer.group_prefix = self.control_id  # so a restarted service never reuses a group id
        self.delivered = 0  # samples PUT (reported in heartbeats)
        self.batches = 0
        self.totals: dict[str, float] = {"samples": 0.0, "pause_s": 0.0}
        self.metrics_log = JsonlLog(cfg.run_dir / "metrics" / f"{self.service_id}.jsonl")
        self._heartbeat_stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        reg = self.prom.registry
        self._g_version = Gauge("sluice_rollout_version", "Policy version loaded", registry=reg)
        self._c_samples = Counter("sluice_rollout_samples", "Trajectories produced", registry=reg)
        self._c_pause_s = Counter(
            "sluice_rollout_admission_pause_seconds", "Time paused by admission control", registry=reg
        )
        self._c_put_s = Counter(
            "sluice_rollout_put_seconds", "Time in PUT (backpressure included)", registry=reg
        )

    def run(self) -> int:
        record_endpoint(self.cfg.run_dir, self.service_id, metrics_port=self.prom.start())
        self.weights.start()
        self._heartbeat.start()
        if not self._wait_first_weights():
            return 1
        while not self.stop.is_set():
            if self.weights.error is not None:
                log.error("weight feed failed: %r", self.weights.error)
                return 1
            if self.weights.done:
                log.info("learner announced shutdown; %s stops", self.service_id)
                break
            self._apply_new_weights()
            try:
                self._one_batch()
            except PutAborted:
                continue  # stopping: the loop condition or the feed's state ends the service
        return 0

    def _one_batch(self) -> None:
        granted, pause_s = self._admit()
        self.totals["pause_s"] += pause_s
        self._c_pause_s.inc(pause_s)
        if granted == 0:
            return
        produced = self.producer.produce(granted, self._poll_weights)
        trajs = produced.trajectories if produced is not None else []
        if len(trajs) < granted:  # what the producer did not use (skipped, filtered) goes back
            self.control.refund(self.control_id, granted - len(trajs))
        if produced is None:
            return
        t0 = time.perf_counter()
        if trajs:
            try:
                self.buffer.put(trajs)
            except PutAborted:
                self.control.refund(self.control_id, len(trajs))
                raise
            self.delivered += len(trajs)
        self._record(produced, pause_s, put_s=time.perf_counter() - t0)

    # -- weights -------------------------------------------------------------------------------

    def _wait_first_weights(self) -> bool:
        """Act only with the learner's weights: wait for its first publication."""
        deadline = time.monotonic() + self.cfg.weight_sync.timeout_s
        while not self.stop.is_set() and time.monotonic() < deadline:
            update = self.weights.wait(timeout_s=1.0)
            if update is not None:
                self._load(update)
                log.info("%s: loaded initial weights v%d", self.service_id, update.version)
                return True
            if self.weights.done:
                log.error("weight feed ended before the first weights: %r", self.weights.error)
                return False
        return False

    def _load(self, update: WeightUpdate) -> None:
        self.producer.load_weights(update)
        self._g_version.set(update.version)

    def _apply_new_weights(self) -> None:
        update = self.weights.poll()
        if update is not None:
            self._load(update)

    def _poll_weights(self) -> WeightUpdate | None:
        """Handed to the producer: new weights to take in the middle of a batch, or None."""
        update = self.weights.poll()
        if update is not None:
            self._g_version.set(update.version)
        return update

    def _catch_up(self, version: int) -> bool:
        """Wait until the weights of `version` (the newest published) have arrived."""
        self._apply_new_weights()
        while self.producer.version < version:
            if self.stop.is_set() or self.weights.done:
                return False
            update = self.weights.wait(timeout_s=0.5)
            if update is not None:
                self._load(update)
        return True

    # -- admission -----------------------------------------------------------------------------

    def _admit(self) -> tuple[int, float]:
        """Ask the learner how many samples may start now; pause (taking new weights meanwhile)
        until some may. Returns (samples granted, seconds paused)."""
        want, group_size = self.producer.request()
        if not self.cfg.control.admission:
            return want, 0.0
        t0 = time.perf_counter()
        while not self.stop.is_set() and not self.weights.done:
            reply = self.control.admit(
                self.control_id, want, group_size, self.cfg.control.admit_wait_ms, delivered=self.delivered
            )
            self.weights.observe(reply.weights_version)
            if reply.granted:
                if not self.wait_for_published:
                    self._apply_new_weights()
                elif not self._catch_up(reply.weights_version):
                    self.control.refund(self.control_id, reply.granted)
                    break
                return reply.granted, time.perf_counter() - t0
            if reply.retry_after_ms:  # a long-polled refusal has waited at the server already
                time.sleep(reply.retry_after_ms / 1000.0)
            self._apply_new_weights()
        return 0, time.perf_counter() - t0

    # -- heartbeats and metrics ----------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        """Liveness for the control plane, independent of how long a batch takes."""
        client = ControlClient(
            self.cfg.control.endpoint, timeout_s=max(5.0, self.cfg.control.heartbeat_s), ctx=self._zmq_ctx
        )
        try:
            while not self._heartbeat_stop.is_set():
                stats = {"version": float(self.producer.version), **self.totals}
                try:
                    reply = client.heartbeat(self.control_id, "rollout", stats, delivered=self.delivered)
                    self.weights.observe(reply.weights_version)
                except TimeoutError:
                    log.warning("%s: control plane did not answer a heartbeat", self.service_id)
                except RpcError as e:  # a bug on either side; liveness must go on
                    log.error("%s: heartbeat refused: %s", self.service_id, e)
                self._heartbeat_stop.wait(self.cfg.control.heartbeat_s)
        finally:
            client.close()

    def _record(self, produced: Produced, pause_s: float, put_s: float) -> None:
        self.batches += 1
        samples = len(produced.trajectories)
        self.totals["samples"] += samples
        for key, value in produced.totals.items():
            self.totals[key] = self.totals.get(key, 0.0) + value
        self._c_samples.inc(samples)
        self._c_put_s.inc(put_s)
        self.metrics_log.write(
            {
                "batch": self.batches,
                "version": self.producer.version,
                "samples": samples,
                "pause_s": pause_s,
                "put_s": put_s,
                **produced.record,
            }
        )

    def close(self) -> None:
        self._heartbeat_stop.set()
        if self._heartbeat.is_alive():
            self._heartbeat.join(timeout=10)
        self.weights.stop()
        self.buffer.close()
        self.control.close()
        self.producer.close()
        self.prom.stop()
        self.metrics_log.close()


def run_actor(loop: ActorLoop) -> int:
    """Run a service to its end and close it, also when it fails."""
    try:
        return loop.run()
    finally:
        loop.close()
