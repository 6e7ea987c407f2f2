"""One rollout service: generate groups, score them, tag versions, PUT them to the buffer.

Each iteration: take new weights if a verified version arrived (a safe point: no sequence is
in flight), sample prompts, generate `group_size` completions per prompt, score them, and PUT
the groups. Every token carries the version that sampled it; a trajectory's version is the
oldest of its tokens.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
from prometheus_client import Counter, Gauge

from buffer.client import BufferClient, PutAborted
from rollout_svc.engines.base import Completion, Engine, SamplingParams
from rollout_svc.engines.registry import build_engine
from rollout_svc.tasks.base import Prompt, Task
from rollout_svc.tasks.registry import build_task
from sluice.config.run import RunConfig
from sluice.control.client import ControlClient
from sluice.metrics import JsonlLog, PrometheusEndpoint, record_endpoint
from sluice.modeling import materialize_model_dir
from sluice.trajectory import Trajectory
from weight_sync.receiver import WeightReceiver

log = logging.getLogger(__name__)


@dataclass
class BatchStats:
    pause_s: float  # waiting for admission before this batch
    samples: int
    tokens: int
    reward_mean: float
    generate_s: float
    score_s: float
    put_s: float


class RolloutService:
    def __init__(self, cfg: RunConfig, index: int, stop: threading.Event) -> None:
        self.cfg = cfg
        self.index = index
        self.stop = stop
        self.service_id = f"rollout-{index}"
        rc = cfg.rollout
        torch.set_num_threads(rc.torch_threads)
        model_dir = materialize_model_dir(cfg.model, cfg.run_dir)
        self.engine: Engine = build_engine(rc.engine, model_dir, cfg.model.dtype, rc.seed + 1000 * index)
        self.task: Task = build_task(cfg.task, seed=cfg.run.seed * 7919 + index)
        self.tokenizer = self.engine.tokenizer
        self._check_vocabulary()
        self.sampling = SamplingParams(rc.max_new_tokens, rc.temperature)
        self.receiver = WeightReceiver(
            cfg.weight_sync, rank=index + 1, world_size=rc.services + 1, device=torch.device("cpu")
        )
        self.buffer = BufferClient(
            cfg.buffer.all_endpoints(),
            should_abort=lambda: self.stop.is_set() or self.receiver.finished.is_set(),
        )
        self.control = ControlClient(cfg.control.endpoint)
        self._last_heartbeat = 0.0
        self._totals = {"samples": 0.0, "pause_s": 0.0, "generate_s": 0.0}
        self.metrics_log = JsonlLog(cfg.run_dir / "metrics" / f"{self.service_id}.jsonl")
        self.prom = PrometheusEndpoint(cfg.metrics.prometheus_host, cfg.metrics.port("rollout", index))
        self._g_version = Gauge(
            "sluice_rollout_version", "Policy version loaded", registry=self.prom.registry
        )
        self._c_samples = Counter(
            "sluice_rollout_samples", "Trajectories produced", registry=self.prom.registry
        )
        self._c_tokens = Counter(
            "sluice_rollout_tokens", "Completion tokens generated", registry=self.prom.registry
        )
        self._g_reward = Gauge(
            "sluice_rollout_reward_mean", "Mean reward of the last batch", registry=self.prom.registry
        )
        self._c_gen_s = Counter(
            "sluice_rollout_generate_seconds", "Time generating", registry=self.prom.registry
        )
        self._c_pause_s = Counter(
            "sluice_rollout_admission_pause_seconds",
            "Time paused by admission control",
            registry=self.prom.registry,
        )
        self._c_put_s = Counter(
            "sluice_rollout_put_seconds", "Time in PUT (backpressure included)", registry=self.prom.registry
        )

    def _check_vocabulary(self) -> None:
        vocab = set(self.tokenizer.get_vocab())
        missing = self.task.vocabulary() - vocab
        if missing:
            raise ValueError(
                f"task {self.task.name!r} writes tokens the model's tokenizer lacks: {sorted(missing)}"
            )

    # -- main loop -----------------------------------------------------------------------------

    def run(self) -> int:
        port = self.prom.start()
        record_endpoint(self.cfg.run_dir, self.service_id, metrics_port=port)
        self.receiver.start()
        if not self._wait_first_weights():
            return 1
        batches = 0
        while not self.stop.is_set():
            if self.receiver.finished.is_set() and self.receiver.error is None:
                log.info("learner announced shutdown; %s stops", self.service_id)
                break
            if self.receiver.error is not None:
                log.error("weight receiver died: %r", self.receiver.error)
                return 1
            self.apply_new_weights()
            try:
                stats = self.rollout_batch()
            except PutAborted:
                continue  # stopping: the loop condition or the receiver state ends the service
            if stats is not None:
                batches += 1
                self.record(stats, batches)
            self.maybe_heartbeat()
        return 0

    def _wait_first_weights(self) -> bool:
        """Generate only with the learner's weights: wait for its first publication."""
        deadline = time.monotonic() + self.cfg.weight_sync.timeout_s
        while not self.stop.is_set() and time.monotonic() < deadline:
            weights = self.receiver.wait_for_weights(timeout_s=1.0)
            if weights is not None:
                self.engine.load_weights(weights.tensors, weights.version)
                self._g_version.set(weights.version)
                log.info("%s: loaded initial weights v%d", self.service_id, weights.version)
                return True
            if self.receiver.finished.is_set():
                log.error("weight receiver ended before the first weights: %r", self.receiver.error)
                return False
        return False

    def apply_new_weights(self) -> None:
        weights = self.receiver.take_latest()
        if weights is not None:
            self.engine.load_weights(weights.tensors, weights.version)
            self._g_version.set(weights.version)

    def admit(self) -> tuple[int, float]:
        """Ask the learner how many samples may start now; pause (taking new weights
        meanwhile) until some may. Returns (samples granted, seconds paused)."""
        rc = self.cfg.rollout
        want = rc.prompts_per_batch * rc.group_size
        if not self.cfg.control.admission:
            return want, 0.0
        t0 = time.perf_counter()
        while not self.stop.is_set() and not self.receiver.finished.is_set():
            reply = self.control.admit(self.service_id, want, rc.group_size)
            if reply.granted:
                if not self.catch_up(reply.weights_version):
                    self.control.refund(self.service_id, reply.granted)
                    break
                return reply.granted, time.perf_counter() - t0
            self.maybe_heartbeat()
            time.sleep(reply.retry_after_ms / 1000.0)
            self.apply_new_weights()
        return 0, time.perf_counter() - t0

    def catch_up(self, version: int) -> bool:
        """Admitted work is generated with the newest published weights: wait for them if
        they are still on their way from the receiver thread."""
        self.apply_new_weights()
        while self.engine.version < version:
            if self.stop.is_set() or self.receiver.finished.is_set():
                return False
            weights = self.receiver.wait_for_weights(timeout_s=0.5)
            if weights is not None:
                self.engine.load_weights(weights.tensors, weights.version)
                self._g_version.set(weights.version)
        return True

    def rollout_batch(self) -> BatchStats | None:
        rc = self.cfg.rollout
        granted, pause_s = self.admit()
        self._totals["pause_s"] += pause_s
        self._c_pause_s.inc(pause_s)
        if granted == 0:
            return None
        prompts = self.task.sample(granted // rc.group_size)
        prompt_ids = [self.tokenizer.encode(p.text, add_special_tokens=False) for p in prompts]
        prompt_ids = [[self.tokenizer.bos_token_id, *ids] for ids in prompt_ids]
        t0 = time.perf_counter()
        groups = self.engine.generate(prompt_ids, rc.group_size, self.sampling)
        t1 = time.perf_counter()
        trajs = [
            t
            for prompt, ids, group in zip(prompts, prompt_ids, groups)
            for t in self.build_group(prompt, ids, group)
        ]
        t2 = time.perf_counter()
        try:
            self.buffer.put(trajs)
        except PutAborted:
            self.control.refund(self.service_id, len(trajs))
            raise
        t3 = time.perf_counter()
        return BatchStats(
            pause_s=pause_s,
            samples=len(trajs),
            tokens=sum(len(t.arrays["completion_ids"]) for t in trajs),
            reward_mean=float(np.mean([t.reward for t in trajs])),
            generate_s=t1 - t0,
            score_s=t2 - t1,
            put_s=t3 - t2,
        )

    def build_group(self, prompt: Prompt, prompt_ids: list[int], group: list[Completion]) -> list[Trajectory]:
        group_id = f"{self.service_id}/{prompt.prompt_id}"
        out = []
        for j, c in enumerate(group):
            text = self.tokenizer.decode(c.token_ids.tolist(), skip_special_tokens=True)
            score = self.task.score(prompt, text, c.finished)
            out.append(
                Trajectory(
                    traj_id=f"{group_id}/{j}",
                    group_id=group_id,
                    version=int(c.versions.min()) if len(c.versions) else self.engine.version,
                    group_size=len(group),
                    reward=score.reward,
                    info={**score.info, "truncated": not c.finished},
                    arrays={
                        "prompt_ids": np.asarray(prompt_ids, dtype=np.int32),
                        "completion_ids": c.token_ids.astype(np.int32),
                        "behaviour_logprobs": c.logprobs.astype(np.float32),
                        "token_versions": c.versions.astype(np.int32),
                    },
                )
            )
        return out

    def maybe_heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_heartbeat < self.cfg.control.heartbeat_s:
            return
        self._last_heartbeat = now
        stats = {"version": float(self.engine.version), **self._totals}
        self.control.heartbeat(self.service_id, "rollout", stats)

    def record(self, s: BatchStats, batches: int) -> None:
        self._totals["samples"] += s.samples
        self._totals["generate_s"] += s.generate_s
        self._c_samples.inc(s.samples)
        self._c_tokens.inc(s.tokens)
        self._g_reward.set(s.reward_mean)
        self._c_gen_s.inc(s.generate_s)
        self._c_put_s.inc(s.put_s)
        self.metrics_log.write(
            {
                "batch": batches,
                "pause_s": s.pause_s,
                "version": self.engine.version,
                "samples": s.samples,
                "tokens": s.tokens,
                "reward_mean": s.reward_mean,
                "generate_s": s.generate_s,
                "score_s": s.score_s,
                "put_s": s.put_s,
                "tokens_per_s": s.tokens / max(s.generate_s, 1e-9),
            }
        )

    def close(self) -> None:
        self.receiver.stop()
        self.buffer.close()
        self.control.close()
        self.prom.stop()
        self.metrics_log.close()


def run_rollout(cfg: RunConfig, index: int, stop: threading.Event) -> int:
    service = RolloutService(cfg, index, stop)
    try:
        return service.run()
    finally:
        service.close()
