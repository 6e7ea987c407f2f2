"""Tasks by name or by reference (sluice/plugins.py): a built-in, a `sluice.tasks` entry
point, `package.module:Class` or `path/to/file.py:Class`."""

from __future__ import annotations

from pydantic import ValidationError

from sluice.config.base import Section
from sluice.config.loader import ConfigError, format_validation_error
from sluice.config.task import TaskConfig
from sluice.plugins import resolve
from sluice.rollout_svc.tasks.base import Task
from sluice.rollout_svc.tasks.calculator import CalculatorTask
from sluice.rollout_svc.tasks.dataset import DatasetTask
from sluice.rollout_svc.tasks.digits import CopyTask, ReverseTask
from sluice.rollout_svc.tasks.duel import DuelTask
from sluice.rollout_svc.tasks.propose_solve import ProposeSolveTask

TASKS: dict[str, type[Task]] = {
    t.name: t for t in (CopyTask, ReverseTask, DatasetTask, CalculatorTask, ProposeSolveTask, DuelTask)
}


def task_class(cfg: TaskConfig) -> type[Task]:
    cls = resolve(cfg.name, "tasks", "task.name", TASKS)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ConfigError(f"config error: task.name: {cfg.name!r} is not a subclass of sluice Task")
    config = getattr(cls, "Config", None)
    if not (isinstance(config, type) and issubclass(config, Section)):
        raise ConfigError(
            f"config error: task.name: {cfg.name!r} has no Config (a sluice.config.base.Section "
            "subclass validating task.params)"
        )
    return cls


def build_task(cfg: TaskConfig, seed: int) -> Task:
    cls = task_class(cfg)
    try:
        params = cls.Config.model_validate(cfg.params)
    except ValidationError as e:
        raise ConfigError(f"config error: task.params.{format_validation_error(e)}") from None
    try:
        return cls(params, seed)
    except (FileNotFoundError, ValueError) as e:
        message = str(e)
        prefix = "" if message.startswith("task.params") else "task.params: "
        raise ConfigError(f"config error: {prefix}{message}") from None
