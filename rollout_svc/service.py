"""One rollout service: generate groups, score them, tag versions, PUT them to the buffer.

Each iteration: take new weights if a verified version arrived, ask admission control how
many samples may start (pausing while none may), generate `group_size` completions per
prompt (single turn) or episodes (multi turn), score them, drop zero-variance groups if asked
(their quota goes back), and PUT the groups. Every token carries the version that sampled it;
a trajectory's version is the oldest of its model tokens. With `rollout.on_new_weights`
continue/abort, weights also change in the middle of a generation call (engines/base.py).

A heartbeat thread (its own control connection) reports liveness, live numbers and the
samples delivered so far; if the service dies, the control plane gives back the quota it held.
A sim service (engine=sim) imports no torch: its "weights" are versions learned from the
control plane.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np
from prometheus_client import Counter, Gauge

from buffer.client import BufferClient, PutAborted
from rollout_svc.engines.base import Engine, SamplingParams, WeightUpdate
from rollout_svc.engines.registry import build_engine
from rollout_svc.episodes import Sample, multi_turn, single_turn
from rollout_svc.tasks.base import Prompt, Task
from rollout_svc.tasks.registry import build_task
from rollout_svc.weights import ReceiverFeed, VersionFeed, WeightFeed
from sluice.config.run import RunConfig
from sluice.control.client import ControlClient
from sluice.launch.threads import role_threads
from sluice.metrics import JsonlLog, PrometheusEndpoint, record_endpoint
from sluice.rpc import RpcError
from sluice.security import secure_context
from sluice.trajectory import Trajectory

log = logging.getLogger(__name__)


@dataclass
class BatchStats:
    pause_s: float  # waiting for admission before this batch
    samples: int  # PUT to the buffer
    tokens: int  # completion tokens of the samples PUT (model and environment)
    reward_mean: float  # over every generated sample (dropped groups included)
    generate_s: float
    score_s: float  # building trajectories (single-turn scoring happens inside generate_s)
    put_s: float
    dropped_groups: int  # zero-variance groups dropped (DAPO filter)
    discarded_tokens: int  # tokens thrown away by abort-mode restarts
    truncated: int  # samples cut at their token budget
    version_spans: int  # samples whose tokens came from more than one version


class RolloutService:
    def __init__(self, cfg: RunConfig, index: int, stop: threading.Event) -> None:
        self.cfg = cfg
        self.index = index
        self.stop = stop
        self.service_id = f"rollout-{index}"
        # Accounting identity on the control plane: a restarted service is a new incarnation.
        self.control_id = f"{self.service_id}.{uuid.uuid4().hex[:8]}"
        rc = cfg.rollout
        if rc.engine != "sim":
            import torch

            torch.set_num_threads(role_threads(rc.torch_threads))
        self.engine: Engine = build_engine(cfg, rc.seed + 1000 * index)
        self.task: Task = build_task(cfg.task, seed=cfg.run.seed * 7919 + index)
        self.tokenizer = self.engine.tokenizer
        self._check_vocabulary()
        self.sampling = SamplingParams(rc.max_new_tokens, rc.temperature, rc.on_new_weights)
        self.zmq_ctx = secure_context(cfg.security, "client")  # None: plain sockets
        self.weights: WeightFeed = self._make_weight_feed()
        self.buffer = BufferClient(
            cfg.buffer.all_endpoints(),
            should_abort=lambda: self.stop.is_set() or self.weights.done,
            ctx=self.zmq_ctx,
        )
        self.control = ControlClient(cfg.control.endpoint, ctx=self.zmq_ctx)
        self.delivered = 0  # samples PUT (reported in heartbeats)
        self.overlong_prompts = 0  # prompts skipped: no room left to answer
        self._totals = {"samples": 0.0, "pause_s": 0.0, "generate_s": 0.0, "dropped_groups": 0.0}
        self._heartbeat_stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self.metrics_log = JsonlLog(cfg.run_dir / "metrics" / f"{self.service_id}.jsonl")
        self.prom = PrometheusEndpoint(cfg.metrics.prometheus_host, cfg.metrics.port("rollout", index))
        self._init_metrics()

    def _make_weight_feed(self) -> WeightFeed:
        """The one place that knows where weights come from (weight_sync owns the receiver)."""
        if self.cfg.rollout.engine == "sim":
            return VersionFeed()
        import torch

        from weight_sync.receiver import WeightReceiver

        receiver = WeightReceiver(
            self.cfg.weight_sync,
            service_id=self.service_id,
            device=torch.device("cpu"),
            control_endpoint=self.cfg.control.endpoint,
            zmq_ctx=self.zmq_ctx,
        )
        return ReceiverFeed(receiver)

    def _init_metrics(self) -> None:
        reg = self.prom.registry
        self._g_version = Gauge("sluice_rollout_version", "Policy version loaded", registry=reg)
        self._c_samples = Counter("sluice_rollout_samples", "Trajectories produced", registry=reg)
        self._c_tokens = Counter("sluice_rollout_tokens", "Completion tokens generated", registry=reg)
        self._g_reward = Gauge("sluice_rollout_reward_mean", "Mean reward of the last batch", registry=reg)
        self._c_gen_s = Counter("sluice_rollout_generate_seconds", "Time generating", registry=reg)
        self._c_pause_s = Counter(
            "sluice_rollout_admission_pause_seconds", "Time paused by admission control", registry=reg
        )
        self._c_put_s = Counter(
            "sluice_rollout_put_seconds", "Time in PUT (backpressure included)", registry=reg
        )
        self._c_dropped = Counter(
            "sluice_rollout_dropped_groups", "Zero-variance groups dropped (DAPO filter)", registry=reg
        )
        self._c_overlong = Counter(
            "sluice_rollout_overlong_prompts", "Prompts skipped: longer than the context", registry=reg
        )
        self._c_discarded = Counter(
            "sluice_rollout_discarded_tokens", "Tokens thrown away by abort-mode restarts", registry=reg
        )

    def _check_vocabulary(self) -> None:
        unk = self.tokenizer.unk_token_id
        missing = {
            w for w in self.task.vocabulary() if unk in self.tokenizer.encode(w, add_special_tokens=False)
        }
        if missing:
            raise ValueError(
                f"task {self.task.name!r} writes tokens the model's tokenizer lacks: {sorted(missing)[:20]}"
            )

    # -- main loop -----------------------------------------------------------------------------

    def run(self) -> int:
        port = self.prom.start()
        record_endpoint(self.cfg.run_dir, self.service_id, metrics_port=port)
        self.weights.start()
        self._heartbeat.start()
        if not self._wait_first_weights():
            return 1
        batches = 0
        while not self.stop.is_set():
            if self.weights.error is not None:
                log.error("weight feed failed: %r", self.weights.error)
                return 1
            if self.weights.done:
                log.info("learner announced shutdown; %s stops", self.service_id)
                break
            self.apply_new_weights()
            try:
                stats = self.rollout_batch()
            except PutAborted:
                continue  # stopping: the loop condition or the feed's state ends the service
            if stats is not None:
                batches += 1
                self.record(stats, batches)
        return 0

    def _wait_first_weights(self) -> bool:
        """Generate only with the learner's weights: wait for its first publication."""
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
        self.engine.load_weights(update.tensors, update.version)
        self._g_version.set(update.version)

    def apply_new_weights(self) -> None:
        update = self.weights.poll()
        if update is not None:
            self._load(update)

    def poll_weights(self) -> WeightUpdate | None:
        """Handed to the engine: new weights to take between decode steps, or None."""
        update = self.weights.poll()
        if update is not None:
            self._g_version.set(update.version)
        return update

    def admit(self) -> tuple[int, float]:
        """Ask the learner how many samples may start now; pause (taking new weights
        meanwhile) until some may. Returns (samples granted, seconds paused)."""
        rc = self.cfg.rollout
        want = rc.prompts_per_batch * rc.group_size
        if not self.cfg.control.admission:
            return want, 0.0
        t0 = time.perf_counter()
        while not self.stop.is_set() and not self.weights.done:
            reply = self.control.admit(self.control_id, want, rc.group_size, self.cfg.control.admit_wait_ms)
            self.weights.observe(reply.weights_version)
            if reply.granted:
                # With no staleness slack, a sample begun on older weights is always dropped.
                wait = rc.wait_for_published_weights or self.cfg.learner.max_staleness == 0
                if not wait:
                    self.apply_new_weights()
                elif not self.catch_up(reply.weights_version):
                    self.control.refund(self.control_id, reply.granted)
                    break
                return reply.granted, time.perf_counter() - t0
            if reply.retry_after_ms:  # a long-polled refusal has waited at the server already
                time.sleep(reply.retry_after_ms / 1000.0)
            self.apply_new_weights()
        return 0, time.perf_counter() - t0

    def catch_up(self, version: int) -> bool:
        """With rollout.wait_for_published_weights, admitted work is generated with the newest
        published weights: wait for them if they are still on their way."""
        self.apply_new_weights()
        while self.engine.version < version:
            if self.stop.is_set() or self.weights.done:
                return False
            update = self.weights.wait(timeout_s=0.5)
            if update is not None:
                self._load(update)
        return True

    def rollout_batch(self) -> BatchStats | None:
        rc = self.cfg.rollout
        granted, pause_s = self.admit()
        self._totals["pause_s"] += pause_s
        self._c_pause_s.inc(pause_s)
        if granted == 0:
            return None
        prompts, prompt_ids = self.sample_prompts(granted // rc.group_size)
        if not prompts:
            self.control.refund(self.control_id, granted)
            return None
        t0 = time.perf_counter()
        run = multi_turn if self.task.multi_turn else single_turn
        groups = run(
            self.engine, self.task, prompts, prompt_ids, rc.group_size, self.sampling,
            self.poll_weights, rc.truncated_reward,
        )  # fmt: skip
        t1 = time.perf_counter()
        all_samples = [s for g in groups for s in g]
        kept = [(p, ids, g) for p, ids, g in zip(prompts, prompt_ids, groups) if self.keep_group(g)]
        trajs = [t for p, ids, g in kept for t in self.build_group(p, ids, g)]
        dropped = len(groups) - len(kept)
        if len(trajs) < granted:  # over-long prompts and dropped groups give their quota back
            self.control.refund(self.control_id, granted - len(trajs))
        t2 = time.perf_counter()
        if trajs:
            try:
                self.buffer.put(trajs)
            except PutAborted:
                self.control.refund(self.control_id, len(trajs))
                raise
            self.delivered += len(trajs)
        t3 = time.perf_counter()
        return BatchStats(
            pause_s=pause_s,
            samples=len(trajs),
            tokens=sum(len(t.arrays["completion_ids"]) for t in trajs),
            reward_mean=float(np.mean([s.reward for s in all_samples])),
            generate_s=t1 - t0,
            score_s=t2 - t1,
            put_s=t3 - t2,
            dropped_groups=dropped,
            discarded_tokens=sum(s.discarded_tokens for s in all_samples),
            truncated=sum(not s.finished for s in all_samples),
            version_spans=sum(len(np.unique(s.versions)) > 1 for s in all_samples),
        )

    def sample_prompts(self, n: int) -> tuple[list[Prompt], list[list[int]]]:
        """The task's next `n` prompts, tokenized, without those that leave the model no room
        to answer (counted and logged; their quota is refunded by the caller)."""
        prompts, ids = [], []
        for p in self.task.sample(n):
            tokens = [self.tokenizer.bos_token_id, *self.tokenizer.encode(p.text, add_special_tokens=False)]
            if len(tokens) >= self.engine.max_model_len:
                self.overlong_prompts += 1
                self._c_overlong.inc()
                log.warning("%s: prompt %s has %d tokens, max_model_len is %d: skipped",
                            self.service_id, p.prompt_id, len(tokens), self.engine.max_model_len)  # fmt: skip
                continue
            prompts.append(p)
            ids.append(tokens)
        return prompts, ids

    def keep_group(self, group: list[Sample]) -> bool:
        """DAPO's filter: a group whose rewards are all equal has zero advantages."""
        if not self.cfg.rollout.drop_zero_variance_groups or len(group) < 2:
            return True
        rewards = [s.reward for s in group]
        return max(rewards) - min(rewards) > 1e-9

    def build_group(self, prompt: Prompt, prompt_ids: list[int], group: list[Sample]) -> list[Trajectory]:
        group_id = f"{self.control_id}/{prompt.prompt_id}"
        out = []
        for j, s in enumerate(group):
            arrays = {
                "prompt_ids": np.asarray(prompt_ids, dtype=np.int32),
                "completion_ids": s.completion_ids.astype(np.int32),
                "behaviour_logprobs": s.logprobs.astype(np.float32),
                "token_versions": s.versions.astype(np.int32),
            }
            if s.loss_mask is not None:
                arrays["loss_mask"] = s.loss_mask.astype(np.uint8)
            out.append(
                Trajectory(
                    traj_id=f"{group_id}/{j}",
                    group_id=group_id,
                    version=s.version if len(s.versions) else self.engine.version,
                    group_size=len(group),
                    reward=s.reward,
                    info=dict(s.info),
                    arrays=arrays,
                )
            )
        return out

    # -- heartbeats and metrics ----------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        """Liveness for the control plane, independent of how long a generate call takes."""
        client = ControlClient(
            self.cfg.control.endpoint, timeout_s=max(5.0, self.cfg.control.heartbeat_s), ctx=self.zmq_ctx
        )
        try:
            while not self._heartbeat_stop.is_set():
                stats = {"version": float(self.engine.version), **self._totals}
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

    def record(self, s: BatchStats, batches: int) -> None:
        self._totals["samples"] += s.samples
        self._totals["generate_s"] += s.generate_s
        self._totals["dropped_groups"] += s.dropped_groups
        self._c_samples.inc(s.samples)
        self._c_tokens.inc(s.tokens)
        self._g_reward.set(s.reward_mean)
        self._c_gen_s.inc(s.generate_s)
        self._c_put_s.inc(s.put_s)
        self._c_dropped.inc(s.dropped_groups)
        self._c_discarded.inc(s.discarded_tokens)
        self.metrics_log.write(
            {
                "batch": batches,
                "version": self.engine.version,
                **vars(s),
                "tokens_per_s": s.tokens / max(s.generate_s, 1e-9),
            }
        )

    def close(self) -> None:
        self._heartbeat_stop.set()
        self._heartbeat.join(timeout=10)
        self.weights.stop()
        self.buffer.close()
        self.control.close()
        self.engine.close()
        self.prom.stop()
        self.metrics_log.close()


def run_rollout(cfg: RunConfig, index: int, stop: threading.Event) -> int:
    service = RolloutService(cfg, index, stop)
    try:
        return service.run()
    finally:
        service.close()
