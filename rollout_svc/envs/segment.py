"""A trajectory segment of classic RL: T steps of one environment, as named arrays.

Arrays of one segment (T = env.unroll_length, D = observation size, A = number of actions):
    obs                 float32 [T+1, D]  observations; obs[T] is the state after the last step
    actions             int64   [T]
    rewards             float32 [T]
    terminated          bool    [T]      the episode reached a terminal state after step t
    truncated           bool    [T]      the episode was cut (time limit) after step t
    behaviour_logits    float32 [T, A]   the acting policy's logits
    behaviour_logprobs  float32 [T]      log mu(a_t | s_t)
    final_index         int32   [K]      steps t where the episode was truncated ...
    final_obs           float32 [K, D]   ... and the state it was cut at (for bootstrapping)
    episode_returns     float32 [E]      returns of the episodes that ended in this segment
    episode_lengths     int32   [E]
After an episode ends at step t, obs[t+1] is the first state of the next one. Every step of a
segment is taken with the same policy version (the trajectory's `version`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SEGMENT_ARRAYS = (
    "obs",
    "actions",
    "rewards",
    "terminated",
    "truncated",
    "behaviour_logits",
    "behaviour_logprobs",
    "final_index",
    "final_obs",
    "episode_returns",
    "episode_lengths",
)


@dataclass
class Segment:
    arrays: dict[str, np.ndarray]

    @property
    def steps(self) -> int:
        return len(self.arrays["actions"])

    @property
    def reward(self) -> float:
        return float(self.arrays["rewards"].sum())
