"""Rollout services: engine, sampling and the task they run."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from sluice.config.base import Section


class TaskConfig(Section):
    name: str = "copy"
    """Registered task (see rollout_svc.tasks.registry)."""
    params: dict[str, Any] = {}
    """Task-specific settings, validated by the task's own config model."""
    eval_every: int = Field(0, ge=0)
    """Not used by the skeleton; reserved for held-out evaluation."""


class RolloutConfig(Section):
    kind: Literal["llm", "env"] = "llm"
    """llm: language-model generation for `task` (rollout_svc/service.py); env: gymnasium
    environments with an MLP policy (`env`, rollout_svc/env_service.py)."""
    services: int = Field(2, ge=0)
    """Rollout service processes started by the local launcher."""
    engine: Literal["hf"] = "hf"
    """Generation engine: hf (transformers)."""
    group_size: int = Field(16, ge=1)
    """Completions sampled per prompt (a GRPO group)."""
    prompts_per_batch: int = Field(8, ge=1)
    """Prompts per generation call; a call yields prompts_per_batch * group_size samples."""
    max_new_tokens: int = Field(8, ge=1)
    """Longest completion; longer ones are truncated (info.truncated = True)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; behaviour log-probs are those of the tempered distribution."""
    torch_threads: int = Field(1, ge=1)
    """intra-op threads of each service (keep services * threads <= cores)."""
    seed: int = 0
    """Base sampling seed; service i uses seed + 1000 * i."""
