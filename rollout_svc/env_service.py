"""The env rollout service (`rollout.kind: env`): gymnasium environments and an MLP policy;
one batch is `num_envs` segments of `unroll_length` steps, PUT as one group.

Everything around a batch (weights, admission, PUT, heartbeats) is the actor loop's (actor.py),
the same as for LLM rollouts. With several policies (`learner.policies`), service i serves
policies[i % n] and talks to that policy's learner group only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

import numpy as np
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge

from sluice.config.policy import policy_of_service, policy_view
from sluice.config.rollout import rollout_service_id
from sluice.config.run import RunConfig
from sluice.launch.threads import role_threads
from sluice.metrics import PrometheusEndpoint
from sluice.modeling.policy import load_policy_model, materialize_policy_dir
from sluice.rollout_svc.actor import ActorLoop, OnePolicy, PollWeights, Produced, connect, run_actor
from sluice.rollout_svc.envs.gym_runner import GymRunner
from sluice.rollout_svc.envs.segment import Segment
from sluice.rollout_svc.weights import receiver_feed
from sluice.trajectory import Trajectory


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


class EnvProducer(OnePolicy):
    """Makes one batch: unroll the environments `unroll_length` steps with the MLP policy and
    return the segments as one group (every step of a segment has the same version)."""

    def __init__(self, cfg: RunConfig, index: int, registry: CollectorRegistry) -> None:
        self.cfg = cfg
        self.policy_id, _ = policy_of_service(cfg, index)
        self.service_id = rollout_service_id(index)
        self.group_prefix = self.service_id  # the loop sets its incarnation's id
        torch.set_num_threads(role_threads(cfg.rollout.torch_threads))
        model, _ = load_policy_model(cfg, materialize_policy_dir(cfg), torch.device("cpu"))
        self.actor = self.acting = MLPActor(model, seed=cfg.rollout.seed + 1000 * index)
        self.runner = GymRunner(cfg.env, seed=cfg.env.seed + 10000 * index)
        self.unrolls = 0
        self._c_steps = Counter("sluice_rollout_env_steps", "Environment steps taken", registry=registry)
        self._c_episodes = Counter("sluice_rollout_episodes", "Episodes finished", registry=registry)
        self._g_return = Gauge(
            "sluice_rollout_return_mean", "Mean return of the last unroll", registry=registry
        )

    def request(self) -> dict[str, tuple[int, int]]:
        n = self.runner.num_envs
        return {self.policy_id: (n, n)}  # one group of num_envs segments

    def produce(self, granted: Mapping[str, int], polls: Mapping[str, PollWeights]) -> Produced:
        """Weights change only between unrolls, so `polls` is not used."""
        t0 = time.perf_counter()
        segments = self.runner.unroll(self.actor)
        unroll_s = time.perf_counter() - t0
        returns = np.concatenate([s.arrays["episode_returns"] for s in segments])
        steps = sum(s.steps for s in segments)
        self._c_steps.inc(steps)
        self._c_episodes.inc(len(returns))
        if len(returns):
            self._g_return.set(float(returns.mean()))
        record = {
            "steps": steps,
            "episodes": len(returns),
            "return_mean": float(returns.mean()) if len(returns) else None,
            "unroll_s": unroll_s,
            "steps_per_s": steps / max(unroll_s, 1e-9),
        }
        return Produced(self.to_trajectories(segments), record, {"steps": steps, "unroll_s": unroll_s})

    def to_trajectories(self, segments: list[Segment]) -> list[Trajectory]:
        self.unrolls += 1
        group_id = f"{self.group_prefix}/{self.unrolls}"
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

    def close(self) -> None:
        self.runner.close()


def build_env_actor(cfg: RunConfig, index: int, stop: threading.Event) -> ActorLoop:
    """Env rollout service `index`: it serves policies[i % n] and talks to that policy's learner
    group only (the policy's view of the config)."""
    policy = policy_of_service(cfg, index)[0]
    cfg = policy_view(cfg, policy)
    prom = PrometheusEndpoint(cfg.metrics.prometheus_host, cfg.metrics.port("rollout", index))
    producer = EnvProducer(cfg, index, prom.registry)
    conn = connect(cfg, stop, prom, receiver_feed, {policy: cfg}, producer.service_id)
    return ActorLoop(cfg, index, stop, producer, conn, wait_for_published=True)


def run_env_rollout(cfg: RunConfig, index: int, stop: threading.Event) -> int:
    return run_actor(build_env_actor(cfg, index, stop))
