"""Steps a batch of gymnasium environments with a policy and cuts the stream into segments.

One `GymRunner` owns `num_envs` environments in a gymnasium `SyncVectorEnv` with same-step
autoreset: when an episode ends, `step` returns the first observation of the next one and
puts the final observation in `info["final_obs"]`, so every step of the stream is a real
transition and truncated episodes can be bootstrapped from their final state. Episode returns
are tracked here across segment boundaries.
"""

from __future__ import annotations

from collections.abc import Callable

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

from sluice.config.env import EnvConfig
from sluice.rollout_svc.envs.segment import Segment
from sluice.rollout_svc.envs.spec import env_spec

# obs [N, D] float32 -> (actions [N] int64, logits [N, A] float32, logprobs [N] float32)
PolicyFn = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


class GymRunner:
    def __init__(self, cfg: EnvConfig, seed: int) -> None:
        self.cfg = cfg
        self.envs = gym.make_vec(
            env_spec(cfg.id),
            num_envs=cfg.num_envs,
            vectorization_mode="sync",
            vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP},
            **cfg.kwargs,
        )
        self.obs, _ = self.envs.reset(seed=seed)  # env j is seeded with seed + j
        self.obs = self.obs.astype(np.float32)
        self.episode_return = np.zeros(cfg.num_envs, dtype=np.float64)
        self.episode_length = np.zeros(cfg.num_envs, dtype=np.int64)
        self.steps_taken = 0

    @property
    def num_envs(self) -> int:
        return self.cfg.num_envs

    def unroll(self, policy: PolicyFn) -> list[Segment]:
        """`unroll_length` steps of every environment: one segment per environment."""
        n, t_len = self.cfg.num_envs, self.cfg.unroll_length
        obs = np.empty((t_len + 1, n, self.obs.shape[1]), dtype=np.float32)
        actions = np.empty((t_len, n), dtype=np.int64)
        rewards = np.empty((t_len, n), dtype=np.float32)
        terminated = np.empty((t_len, n), dtype=bool)
        truncated = np.empty((t_len, n), dtype=bool)
        logprobs = np.empty((t_len, n), dtype=np.float32)
        logits_steps = []
        finals: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
        episodes: list[list[tuple[float, int]]] = [[] for _ in range(n)]
        for t in range(t_len):
            obs[t] = self.obs
            a, logits, lp = policy(self.obs)
            nxt, r, term, trunc, info = self.envs.step(a)
            actions[t], rewards[t], terminated[t], truncated[t], logprobs[t] = a, r, term, trunc, lp
            logits_steps.append(logits)
            self.episode_return += r
            self.episode_length += 1
            for j in np.flatnonzero(term | trunc):
                if trunc[j] and not term[j]:
                    finals[j].append((t, np.asarray(info["final_obs"][j], dtype=np.float32)))
                episodes[j].append((float(self.episode_return[j]), int(self.episode_length[j])))
                self.episode_return[j] = 0.0
                self.episode_length[j] = 0
            self.obs = nxt.astype(np.float32)
        obs[t_len] = self.obs
        self.steps_taken += n * t_len
        logits = np.stack(logits_steps)  # [T, N, A]
        dim = self.obs.shape[1]
        return [
            Segment(
                {
                    "obs": np.ascontiguousarray(obs[:, j]),
                    "actions": np.ascontiguousarray(actions[:, j]),
                    "rewards": np.ascontiguousarray(rewards[:, j]),
                    "terminated": np.ascontiguousarray(terminated[:, j]),
                    "truncated": np.ascontiguousarray(truncated[:, j]),
                    "behaviour_logits": np.ascontiguousarray(logits[:, j]),
                    "behaviour_logprobs": np.ascontiguousarray(logprobs[:, j]),
                    "final_index": np.asarray([t for t, _ in finals[j]], dtype=np.int32),
                    "final_obs": np.asarray([o for _, o in finals[j]], dtype=np.float32).reshape(-1, dim),
                    "episode_returns": np.asarray([r for r, _ in episodes[j]], dtype=np.float32),
                    "episode_lengths": np.asarray([k for _, k in episodes[j]], dtype=np.int32),
                }
            )
            for j in range(n)
        ]

    def close(self) -> None:
        self.envs.close()
