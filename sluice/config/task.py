"""The task a rollout service runs: its prompts and its rewards (docs/extending.md)."""

from __future__ import annotations

from typing import Any

from sluice.config.base import Section


class TaskConfig(Section):
    name: str = "copy"
    """Registered task (see rollout_svc.tasks.registry)."""
    params: dict[str, Any] = {}
    """Task-specific settings, validated by the task's own config model."""
