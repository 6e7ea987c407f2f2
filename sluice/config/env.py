"""Classic-RL environments (gymnasium) run by env rollout services (`rollout.kind: env`)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from sluice.config.base import Section
from sluice.plugins import PluginRef


class EnvConfig(Section):
    id: PluginRef = "CartPole-v1"
    """gymnasium environment id (gymnasium.make), a `sluice.envs` entry point, or a reference
    to an Env class or creator function (`package.module:make_env`, `path/to/file.py:MyEnv`)."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments of gymnasium.make."""
    num_envs: int = Field(default=16, ge=1)
    """Environments stepped together by one rollout service (a gymnasium SyncVectorEnv). One
    unroll yields one group of num_envs trajectories."""
    unroll_length: int = Field(default=64, ge=1)
    """Steps per trajectory segment (IMPALA's unroll length T)."""
    seed: int = 0
    """Base seed of the environments; service i, env j uses seed + 10000 * i + j."""
