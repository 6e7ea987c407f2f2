"""One env rollout service (`rollout.kind: env`): gymnasium environments, an MLP policy,
segments PUT to the buffer.

Each iteration: take new weights if a verified version arrived (between unrolls: every step
of a segment has the same version), ask admission for one group of `num_envs` segments, unroll
the environments `unroll_length` steps, and PUT the segments as one group. It uses the same
buffer, control plane and weight channel as the LLM rollout loop; with several policies
(`learner.policies`), service i serves policies[i % n] and talks to that policy's learner
group only.
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
from rollout_svc.envs.gym_runner import GymRunner
from rollout_svc.envs.segment import Segment
from sluice.config.policy import policy_of_service, policy_view
from sluice.config.run import RunConfig
from sluice.control.client import ControlClient
from sluice.launch.threads import role_threads
from sluice.metrics import JsonlLog, PrometheusEndpoint, record_endpoint
from sluice.modeling.policy import load_policy_model, materialize_policy_dir
from sluice.security import secure_context
from sluice.trajectory import Trajectory
from weight_sync.receiver import WeightReceiver

log = logging.getLogger(__name__)


@dataclass
class UnrollStats:
    pause_s: float
    unroll_s: float
    put_s: float
    steps: int
    episodes: int
    return_mean: float  # of the episodes that ended in this unroll (nan if none)


class MLPActor:
    """Samples actions from the MLP policy's logits (a seeded torch generator)."""

    def __init__(self, model: torch.nn.Module, seed: int) -> None:
        self.model = model.eval()
        self.generator = torch.Generator().manual_seed(seed)
        self.version = 0

    @torch.no_grad()
    def __call__(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        logits, _ = self.model(torch.from_numpy(obs))
        logp = torch.log_softmax(logits.float(), dim=-1)
        actions = torch.multinomial(logp.exp(), 1, generator=self.generator).squeeze(-1)
        chosen = logp.gather(-1, actions[:, None]).squeeze(-1)
        return actions.numpy(), logits.float().numpy(), chosen.numpy()

    def load_weights(self, tensors, version: int) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in tensors:
                params[name].copy_(tensor)
        self.version = version


class EnvRolloutService:
    def __init__(self, cfg: RunConfig, index: int, stop: threading.Event) -> None:
        self.policy_id, _ = policy_of_service(cfg, index)
        self.cfg = cfg = policy_view(cfg, self.policy_id)
        self.index = index
        self.stop = stop
        self.service_id = f"rollout-{index}"
        torch.set_num_threads(role_threads(cfg.rollout.torch_threads))
        model, _ = load_policy_model(cfg, materialize_policy_dir(cfg), torch.device("cpu"))
        self.actor = MLPActor(model, seed=cfg.rollout.seed + 1000 * index)
        self.runner = GymRunner(cfg.env, seed=cfg.env.seed + 10000 * index)
        zmq_ctx = secure_context(cfg.security, "client")  # None: plain sockets
        self.receiver = WeightReceiver(
            cfg.weight_sync,
            service_id=self.service_id,
            device=torch.device("cpu"),
            control_endpoint=cfg.control.endpoint,
            zmq_ctx=zmq_ctx,
        )
        self.buffer = BufferClient(
            cfg.buffer.all_endpoints(),
            should_abort=lambda: self.stop.is_set() or self.receiver.finished.is_set(),
            ctx=zmq_ctx,
        )
        self.control = ControlClient(cfg.control.endpoint, ctx=zmq_ctx)
        self.unrolls = 0
        self._last_heartbeat = 0.0
        self._totals = {"samples": 0.0, "steps": 0.0, "pause_s": 0.0, "unroll_s": 0.0}
        self.metrics_log = JsonlLog(cfg.run_dir / "metrics" / f"{self.service_id}.jsonl")
        self.prom = PrometheusEndpoint(cfg.metrics.prometheus_host, cfg.metrics.port("rollout", index))
        reg = self.prom.registry
        self._g_version = Gauge("sluice_rollout_version", "Policy version loaded", registry=reg)
        self._c_steps = Counter("sluice_rollout_env_steps", "Environment steps taken", registry=reg)
        self._c_episodes = Counter("sluice_rollout_episodes", "Episodes finished", registry=reg)
        self._g_return = Gauge("sluice_rollout_return_mean", "Mean return of the last unroll", registry=reg)
        self._c_pause = Counter(
            "sluice_rollout_admission_pause_seconds", "Time paused by admission control", registry=reg
        )

    # -- main loop -----------------------------------------------------------------------------

    def run(self) -> int:
        record_endpoint(self.cfg.run_dir, self.service_id, metrics_port=self.prom.start())
        self.receiver.start()
        if not self.wait_first_weights():
            return 1
        while not self.stop.is_set():
            if self.receiver.finished.is_set():
                if self.receiver.error is not None:
                    log.error("weight receiver died: %r", self.receiver.error)
                    return 1
                log.info("learner announced shutdown; %s stops", self.service_id)
                break
            self.apply_new_weights()
            try:
                stats = self.unroll_once()
            except PutAborted:
                continue
            if stats is not None:
                self.record(stats)
            self.maybe_heartbeat()
        return 0

    def wait_first_weights(self) -> bool:
        """Act only with weights the learner published: wait for its first publication."""
        deadline = time.monotonic() + self.cfg.weight_sync.timeout_s
        while not self.stop.is_set() and time.monotonic() < deadline:
            weights = self.receiver.wait_for_weights(timeout_s=1.0)
            if weights is not None:
                self.actor.load_weights(weights.tensors, weights.version)
                self._g_version.set(weights.version)
                return True
            if self.receiver.finished.is_set():
                log.error("weight receiver ended before the first weights: %r", self.receiver.error)
                return False
        return False

    def apply_new_weights(self) -> None:
        weights = self.receiver.take_latest()
        if weights is not None:
            self.actor.load_weights(weights.tensors, weights.version)
            self._g_version.set(weights.version)

    def admit(self) -> tuple[bool, float]:
        """One group of num_envs segments may start? Pauses (taking new weights) until it may,
        then waits for the newest published weights. Returns (admitted, seconds paused)."""
        n = self.runner.num_envs
        t0 = time.perf_counter()
        if not self.cfg.control.admission:
            return True, 0.0
        while not self.stop.is_set() and not self.receiver.finished.is_set():
            reply = self.control.admit(self.service_id, n, n, self.cfg.control.admit_wait_ms)
            if reply.granted:
                if self.catch_up(reply.weights_version):
                    return True, time.perf_counter() - t0
                self.control.refund(self.service_id, reply.granted)
                break
            self.maybe_heartbeat()
            if reply.retry_after_ms:  # a long-polled refusal has waited at the server already
                time.sleep(reply.retry_after_ms / 1000.0)
            self.apply_new_weights()
        return False, time.perf_counter() - t0

    def catch_up(self, version: int) -> bool:
        self.apply_new_weights()
        while self.actor.version < version:
            if self.stop.is_set() or self.receiver.finished.is_set():
                return False
            weights = self.receiver.wait_for_weights(timeout_s=0.5)
            if weights is not None:
                self.actor.load_weights(weights.tensors, weights.version)
                self._g_version.set(weights.version)
        return True

    def unroll_once(self) -> UnrollStats | None:
        admitted, pause_s = self.admit()
        self._c_pause.inc(pause_s)
        self._totals["pause_s"] += pause_s
        if not admitted:
            return None
        t0 = time.perf_counter()
        segments = self.runner.unroll(self.actor)
        t1 = time.perf_counter()
        trajs = self.to_trajectories(segments)
        try:
            self.buffer.put(trajs)
        except PutAborted:
            self.control.refund(self.service_id, len(trajs))
            raise
        returns = np.concatenate([s.arrays["episode_returns"] for s in segments])
        return UnrollStats(
            pause_s=pause_s,
            unroll_s=t1 - t0,
            put_s=time.perf_counter() - t1,
            steps=sum(s.steps for s in segments),
            episodes=len(returns),
            return_mean=float(returns.mean()) if len(returns) else float("nan"),
        )

    def to_trajectories(self, segments: list[Segment]) -> list[Trajectory]:
        self.unrolls += 1
        group_id = f"{self.service_id}/{self.unrolls}"
        return [
            Trajectory(
                traj_id=f"{group_id}/{j}",
                group_id=group_id,
                version=self.actor.version,
                group_size=len(segments),
                policy_id=self.policy_id,
                reward=s.reward,
                info={"episodes": len(s.arrays["episode_returns"])},
                arrays=s.arrays,
            )
            for j, s in enumerate(segments)
        ]

    def maybe_heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_heartbeat >= self.cfg.control.heartbeat_s:
            self._last_heartbeat = now
            stats = {"version": float(self.actor.version), **self._totals}
            self.control.heartbeat(self.service_id, "rollout", stats)

    def record(self, s: UnrollStats) -> None:
        self._totals["samples"] += self.runner.num_envs
        self._totals["steps"] += s.steps
        self._totals["unroll_s"] += s.unroll_s
        self._c_steps.inc(s.steps)
        self._c_episodes.inc(s.episodes)
        if s.episodes:
            self._g_return.set(s.return_mean)
        self.metrics_log.write(
            {
                "unroll": self.unrolls,
                "version": self.actor.version,
                "steps": s.steps,
                "episodes": s.episodes,
                "return_mean": None if np.isnan(s.return_mean) else s.return_mean,
                "pause_s": s.pause_s,
                "unroll_s": s.unroll_s,
                "put_s": s.put_s,
                "steps_per_s": s.steps / max(s.unroll_s, 1e-9),
            }
        )

    def close(self) -> None:
        self.receiver.stop()
        self.runner.close()
        self.buffer.close()
        self.control.close()
        self.prom.stop()
        self.metrics_log.close()


def run_env_rollout(cfg: RunConfig, index: int, stop: threading.Event) -> int:
    service = EnvRolloutService(cfg, index, stop)
    try:
        return service.run()
    finally:
        service.close()
