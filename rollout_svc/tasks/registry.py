"""Task plugins by name."""

from __future__ import annotations

from pydantic import ValidationError

from sluice.config.loader import ConfigError, format_validation_error
from sluice.config.task import TaskConfig
from sluice.rollout_svc.tasks.base import Task
from sluice.rollout_svc.tasks.calculator import CalculatorTask
from sluice.rollout_svc.tasks.dataset import DatasetTask
from sluice.rollout_svc.tasks.digits import CopyTask, ReverseTask

TASKS: dict[str, type[Task]] = {t.name: t for t in (CopyTask, ReverseTask, DatasetTask, CalculatorTask)}


def build_task(cfg: TaskConfig, seed: int) -> Task:
    if cfg.name not in TASKS:
        raise ConfigError(f"config error: task.name: {cfg.name!r} is not one of {sorted(TASKS)}")
    cls = TASKS[cfg.name]
    try:
        params = cls.Config.model_validate(cfg.params)
    except ValidationError as e:
        raise ConfigError(f"config error: task.params.{format_validation_error(e)}") from None
    try:
        return cls(params, seed)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"config error: task.params: {e}") from None
