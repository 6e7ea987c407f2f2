"""The actor protocol, written once for every kind of rollout service.

A rollout service (LLM generation in `service.py`, gymnasium environments in `env_service.py`)
supplies only a `Producer`, "make one batch of trajectories with the weights you hold"; this
loop does the rest, the same for both: wait for the learner's first weights, ask admission
control how much may start (catching up to the published weights when asked), have the
producer make a batch, refund the quota it did not use, PUT the batch or refund it, and report
liveness and deliveries from a heartbeat thread so the control plane can give back the quota
of a service that dies. A multi-agent service talks to several policies' learner groups: each
policy is a `PolicyLink` (its weights, its control plane, its quota), and the loop does all of
the above per policy. docs/architecture.md ("Rollout services") tells the story.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import zmq
from prometheus_client import Counter, Gauge

from sluice.buffer.client import BufferClient, PutAborted
from sluice.config.rollout import rollout_service_id
from sluice.config.run import RunConfig
from sluice.control.client import ControlClient
from sluice.launch.heap import freeze_startup_heap, retain_freed_memory
from sluice.launch.threads import apply_placement
from sluice.metrics import JsonlLog, PrometheusEndpoint, record_endpoint
from sluice.rollout_svc.engines.base import WeightUpdate
from sluice.rollout_svc.weights import WeightFeed
from sluice.rpc import RpcAborted, RpcError
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

    def version_of(self, policy: str) -> int:
        """The version of `policy`'s weights it acts with now."""
        ...

    def load_weights(self, policy: str, update: WeightUpdate) -> None: ...

    def request(self) -> dict[str, tuple[int, int]]:
        """Per policy: (samples wanted per batch, group size), what to ask its admission for."""
        ...

    def produce(self, granted: Mapping[str, int], polls: Mapping[str, PollWeights]) -> Produced | None:
        """Make trajectories within `granted` (per policy; None: nothing this time). `polls[p]`
        hands out newer weights of policy p to a producer that takes them mid-batch."""
        ...

    def close(self) -> None: ...


class ActsWithWeights(Protocol):
    """What a single-policy producer acts with: an engine, or the env service's MLP actor."""

    version: int

    def load_weights(self, tensors, version: int) -> None: ...


class OnePolicy:
    """A producer's weight methods when it serves one policy and acts with one model."""

    policy_id: str
    acting: ActsWithWeights

    def version_of(self, policy: str) -> int:
        return self.acting.version

    def load_weights(self, policy: str, update: WeightUpdate) -> None:
        self.acting.load_weights(update.tensors, update.version)


@dataclass
class PolicyLink:
    """One policy's side of a service: its weights, its learner group's control plane, and
    how many of its samples the service has PUT (reported in heartbeats)."""

    policy: str
    weights: WeightFeed
    control: ControlClient
    delivered: int = 0


@dataclass
class ActorConnections:
    """What one incarnation of a service talks to (`connect` builds it from the config)."""

    links: dict[str, PolicyLink]
    buffer: BufferClient
    prom: PrometheusEndpoint
    zmq_ctx: zmq.Context | None  # the secure ZeroMQ context, or None (plain sockets)


def connect(
    cfg: RunConfig,
    stop: threading.Event,
    prom: PrometheusEndpoint,
    weight_feed: Callable[[RunConfig, str, zmq.Context | None], WeightFeed],
    policies: Mapping[str, RunConfig],
    service_id: str,
    zmq_ctx: zmq.Context | None = None,
) -> ActorConnections:
    """The buffer connection and, per policy (`policies`: the config as that policy's roles see
    it), the control-plane and weight connections (`weight_feed(view, service_id, ctx)`) of one
    service; PUTs give up when the service stops or every learner group has shut down.
    `zmq_ctx`: a context shared with other services of this process (a pack), else its own."""
    if zmq_ctx is None:
        zmq_ctx = secure_context(cfg.security, "client")  # None: plain sockets
    links = {}
    for policy, view in policies.items():
        feed = weight_feed(view, service_id, zmq_ctx)
        control = ControlClient(
            view.control.endpoint,
            ctx=zmq_ctx,
            patience_s=view.control.learner_patience_s,
            # Stopping, or the learner group is over (shut down, or its weight feed broke):
            # nobody will answer, so a waiting admission or refund gives up at once.
            should_abort=lambda feed=feed: stop.is_set() or feed.done or feed.error is not None,
        )
        links[policy] = PolicyLink(policy, feed, control)
    buffer = BufferClient(
        cfg.buffer.all_endpoints(),
        should_abort=lambda: stop.is_set() or all(link.weights.done for link in links.values()),
        ctx=zmq_ctx,
    )
    return ActorConnections(links, buffer, prom, zmq_ctx)


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
        self.links = conn.links
        self.buffer = conn.buffer
        self.prom = conn.prom
        self._zmq_ctx = conn.zmq_ctx
        self.wait_for_published = wait_for_published
        self.service_id = rollout_service_id(index)
        # Accounting identity on the control plane: a restarted service is a new incarnation.
        self.control_id = f"{self.service_id}.{uuid.uuid4().hex[:8]}"
        producer.group_prefix = self.control_id  # so a restarted service never reuses a group id
        self.batches = 0
        self.totals: dict[str, float] = {"samples": 0.0, "pause_s": 0.0}
        self.metrics_log = JsonlLog(cfg.run_dir / "metrics" / f"{self.service_id}.jsonl")
        self._heartbeat_stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        reg = self.prom.registry
        self._g_version = Gauge("sluice_rollout_version", "Policy version loaded", ["policy"], registry=reg)
        self._c_samples = Counter("sluice_rollout_samples", "Trajectories produced", registry=reg)
        self._c_pause_s = Counter(
            "sluice_rollout_admission_pause_seconds", "Time paused by admission control", registry=reg
        )
        self._c_put_s = Counter(
            "sluice_rollout_put_seconds", "Time in PUT (backpressure included)", registry=reg
        )

    @property
    def delivered(self) -> int:
        """Samples PUT, every policy's."""
        return sum(link.delivered for link in self.links.values())

    def live(self) -> list[PolicyLink]:
        """The policies whose learner group still trains (the others' agents act, untrained)."""
        return [link for link in self.links.values() if not link.weights.done]

    def run(self) -> int:
        record_endpoint(self.cfg.run_dir, self.service_id, metrics_port=self.prom.start())
        for link in self.links.values():
            link.weights.start()
        self._heartbeat.start()
        log.info("%s: waiting for the first weights of %s", self.service_id, ", ".join(self.links))
        if not all(self._wait_first_weights(link) for link in self.links.values()):
            return 1
        while not self.stop.is_set():
            failed = [link for link in self.links.values() if link.weights.error is not None]
            if failed:
                log.error("weight feed of %s failed: %r", failed[0].policy, failed[0].weights.error)
                return 1
            if not self.live():
                log.info("learner announced shutdown; %s stops", self.service_id)
                break
            self._apply_new_weights()
            try:
                self._one_batch()
            except (PutAborted, RpcAborted):
                continue  # stopping: the loop condition or the feeds' state ends the service
        log.info("%s stops after %d samples delivered", self.service_id, self.delivered)
        return 0

    def _one_batch(self) -> None:
        granted, pause_s = self._admit()
        self.totals["pause_s"] += pause_s
        self._c_pause_s.inc(pause_s)
        if not any(granted.values()):
            return
        polls = {policy: self._poller(policy) for policy in self.links}
        produced = self.producer.produce(granted, polls)
        trajs = produced.trajectories if produced is not None else []
        trained = [t for t in trajs if t.policy_id in granted]  # a finished policy's are not PUT
        made = {policy: sum(t.policy_id == policy for t in trained) for policy in granted}
        self._refund({p: n - made[p] for p, n in granted.items()})  # unused: skipped, filtered
        if produced is None:
            return
        t0 = time.perf_counter()
        if trained:
            try:
                self.buffer.put(trained)
            except PutAborted:
                self._refund(made)
                raise
            for policy, n in made.items():
                self.links[policy].delivered += n
        self._record(produced, len(trained), pause_s, put_s=time.perf_counter() - t0)

    def _refund(self, unused: Mapping[str, int]) -> None:
        for policy, n in unused.items():
            link = self.links[policy]
            if n > 0 and not link.weights.done:  # a finished learner group takes no refunds
                link.control.refund(self.control_id, n)

    # -- weights -------------------------------------------------------------------------------

    def _wait_first_weights(self, link: PolicyLink) -> bool:
        """Act only with the learner's weights: wait for its first publication."""
        deadline = time.monotonic() + self.cfg.weight_sync.timeout_s
        while not self.stop.is_set() and time.monotonic() < deadline:
            update = link.weights.wait(timeout_s=1.0)
            if update is not None:
                self._load(link.policy, update)
                log.info("%s: loaded initial weights of %s v%d", self.service_id, link.policy, update.version)
                return True
            if link.weights.done:
                log.error("weight feed ended before the first weights: %r", link.weights.error)
                return False
        if self.stop.is_set():
            log.info("%s: asked to stop before the first weights of %s", self.service_id, link.policy)
        else:
            log.error("%s: no weights of %s within weight_sync.timeout_s", self.service_id, link.policy)
        return False

    def _load(self, policy: str, update: WeightUpdate) -> None:
        self.producer.load_weights(policy, update)
        self._g_version.labels(policy).set(update.version)

    def _apply_new_weights(self) -> None:
        for link in self.links.values():
            update = link.weights.poll()
            if update is not None:
                self._load(link.policy, update)

    def _poller(self, policy: str) -> PollWeights:
        """Handed to the producer: `policy`'s new weights to take mid-batch, or None."""
        link = self.links[policy]

        def poll() -> WeightUpdate | None:
            update = link.weights.poll()
            if update is not None:
                self._g_version.labels(policy).set(update.version)
            return update

        return poll

    def _catch_up(self, link: PolicyLink, version: int) -> bool:
        """Wait until `link`'s weights of `version` (the newest published, or the newest
        announced to its receiver when the grant came ahead of its report) have arrived; False
        when stopping, or when they did not come within `weight_sync.publish_timeout_s` (the
        caller refunds its grant, so a receiver that missed a version never holds quota)."""
        self._apply_new_weights()
        deadline = time.monotonic() + self.cfg.weight_sync.publish_timeout_s
        while self.producer.version_of(link.policy) < version:
            if self.stop.is_set() or link.weights.done:
                return False
            if time.monotonic() > deadline:
                log.warning("%s: v%d of %s did not arrive; refunding the grant", self.control_id, version,
                            link.policy)  # fmt: skip
                return False
            update = link.weights.wait(timeout_s=0.5)
            if update is not None:
                self._load(link.policy, update)
        return True

    # -- admission -----------------------------------------------------------------------------

    def _admit(self) -> tuple[dict[str, int], float]:
        """Ask each live policy's learner how many of its samples may start now, pausing (taking
        new weights meanwhile) until some may. A policy that grants nothing (stopping, its
        learner done) means no batch: what the others granted goes back. Returns (samples
        granted per policy, seconds paused)."""
        wants = self.producer.request()
        live = [link for link in self.live() if link.policy in wants]
        if not self.cfg.control.admission:
            return {link.policy: wants[link.policy][0] for link in live}, 0.0
        t0 = time.perf_counter()
        granted: dict[str, int] = {}
        for link in live:
            n = self._admit_one(link, *wants[link.policy])
            if n == 0:
                self._refund(granted)
                return {}, time.perf_counter() - t0
            granted[link.policy] = n
        return granted, time.perf_counter() - t0

    def _admit_one(self, link: PolicyLink, want: int, group_size: int) -> int:
        """Samples of `link`'s policy granted (0: the service stops or the learner is done)."""
        while not self.stop.is_set() and not link.weights.done:
            wait_ms = self.cfg.control.admit_wait_ms
            reply = link.control.admit(
                self.control_id,
                want,
                group_size,
                wait_ms,
                delivered=link.delivered,
                member=link.weights.member,
            )
            link.weights.observe(reply.weights_version)
            if reply.granted:
                if not (self.wait_for_published or reply.ahead):
                    self._apply_new_weights()
                elif not self._catch_up(link, reply.weights_version):
                    link.control.refund(self.control_id, reply.granted)
                    return 0
                return reply.granted
            if reply.retry_after_ms:  # a long-polled refusal has waited at the server already
                time.sleep(reply.retry_after_ms / 1000.0)
            self._apply_new_weights()
        return 0

    # -- heartbeats and metrics ----------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        """Liveness for each policy's control plane, independent of how long a batch takes."""
        timeout_s = max(5.0, self.cfg.control.heartbeat_s)
        stopping = self._heartbeat_stop.is_set  # a beat in flight is dropped when the service stops
        clients = {
            p: ControlClient(
                link.control.endpoint, timeout_s=timeout_s, ctx=self._zmq_ctx, should_abort=stopping
            )
            for p, link in self.links.items()
        }
        try:
            while not self._heartbeat_stop.is_set():
                for policy, client in clients.items():
                    self._heartbeat_once(self.links[policy], client)
                self._heartbeat_stop.wait(self.cfg.control.heartbeat_s)
        except RpcAborted:
            pass  # stopping
        finally:
            for client in clients.values():
                client.close()

    def _heartbeat_once(self, link: PolicyLink, client: ControlClient) -> None:
        stats = {"version": float(self.producer.version_of(link.policy)), **self.totals}
        try:
            reply = client.heartbeat(self.control_id, "rollout", stats, delivered=link.delivered)
            link.weights.observe(reply.weights_version)
        except TimeoutError:
            log.warning("%s: control plane of %s did not answer a heartbeat", self.service_id, link.policy)
        except RpcError as e:  # a bug on either side; liveness must go on
            log.error("%s: heartbeat refused by %s: %s", self.service_id, link.policy, e)

    def _record(self, produced: Produced, samples: int, pause_s: float, put_s: float) -> None:
        self.batches += 1
        self.totals["samples"] += samples
        for key, value in produced.totals.items():
            self.totals[key] = self.totals.get(key, 0.0) + value
        self._c_samples.inc(samples)
        self._c_put_s.inc(put_s)
        versions = (
            {f"version/{p}": self.producer.version_of(p) for p in self.links} if len(self.links) > 1 else {}
        )
        self.metrics_log.write(
            {
                "batch": self.batches,
                "version": min(self.producer.version_of(p) for p in self.links),
                **versions,
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
        for link in self.links.values():
            link.weights.stop()
            link.control.close()
        self.buffer.close()
        self.producer.close()
        self.prom.stop()
        self.metrics_log.close()


def run_actor(loop: ActorLoop) -> int:
    """Run a service to its end and close it, also when it fails. Pinned (`sluice run` on a CPU
    host) only from here: building it (imports, the model) uses every core, as the learner's
    start-up does."""
    apply_placement()
    freeze_startup_heap()
    retain_freed_memory()
    try:
        return loop.run()
    finally:
        loop.close()
