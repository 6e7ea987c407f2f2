"""The whole run: every role reads the same file."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from sluice.config.base import Section
from sluice.config.buffer import BufferConfig
from sluice.config.control import ControlConfig
from sluice.config.env import EnvConfig
from sluice.config.learner import LearnerConfig
from sluice.config.loss import check_objective
from sluice.config.model import ModelConfig
from sluice.config.ray import RayConfig
from sluice.config.rollout import RolloutConfig
from sluice.config.security import SecurityConfig
from sluice.config.task import TaskConfig, check_agents
from sluice.config.weight_sync import WeightSyncConfig
from sluice.config.workflow import WorkflowConfig
from sluice.config.workflow_check import check_no_legacy_knobs, check_workflow, read_workflow_source


class RunSection(Section):
    name: str = "sluice"
    """Run name; the default run directory is runs/<name>-<time>."""
    dir: str | None = None
    """Run directory (logs, metrics, checkpoints, plots). Set by the local launcher if None."""
    seed: int = 0
    """Seed of the learner and of the task's prompt stream."""
    pin_cores: bool = True
    """`sluice run` on a CPU host: true gives each CPU learner rank's training thread cores of
    its own (as many as its torch threads) and runs every other role at a lower priority on any
    core, so generation never preempts a step yet uses the training cores while they are idle;
    where the learner's threads take every core, nothing is pinned but the others still yield
    (docs/architecture.md, "Cores and threads"). Other launchers leave placement to their
    scheduler."""
    start_method: Literal["auto", "forkserver", "spawn"] = "auto"
    """How `sluice run` starts the learner ranks and rollout services. forkserver: each is a fork
    of a server that imported torch and transformers once, so a role starts (and restarts) in
    about a second instead of paying ~5 s of CPU for its imports; spawn: a fresh
    `python -m sluice.cli <role>` each. auto: forkserver on Linux with a CPU-only torch build,
    else spawn. Buffer shards and vLLM engines' services are always spawned
    (sluice/launch/forkserver.py)."""


class MetricsConfig(Section):
    prometheus_host: str = "127.0.0.1"
    """Interface the Prometheus endpoints listen on."""
    base_port: int = Field(default=0, ge=0, le=65535)
    """buffer shard k: base+k, learner: base+100, rollout i: base+200+i. 0: free ports."""
    tensorboard: bool = True
    """Learner writes TensorBoard scalars under <run dir>/tb."""

    def port(self, role: str, index: int = 0) -> int:
        if self.base_port == 0:
            return 0
        offset = {"buffer": 0, "learner": 100, "rollout": 200}[role]
        return self.base_port + offset + index


class RunConfig(Section):
    run: RunSection = RunSection()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    env: EnvConfig = EnvConfig()
    buffer: BufferConfig = BufferConfig()
    rollout: RolloutConfig = RolloutConfig()
    learner: LearnerConfig = LearnerConfig()
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    control: ControlConfig = ControlConfig()
    metrics: MetricsConfig = MetricsConfig()
    security: SecurityConfig = SecurityConfig()
    ray: RayConfig = RayConfig()
    workflow: WorkflowConfig | None = None
    """The algorithm as stages (docs/workflows.md): a shipped name (configs/algorithms/<name>.yaml),
    a workflow file's path, or the mapping. None: the workflow learner.loss/llm/classic mean."""

    @field_validator("workflow", mode="before")
    @classmethod
    def _read_workflow(cls, value: object) -> object:
        return read_workflow_source(value)

    @model_validator(mode="after")
    def _check_kinds(self) -> RunConfig:
        want = {"llm": "llm", "env": "mlp"}[self.rollout.kind]
        if self.model.kind != want:
            raise ValueError(
                f"rollout.kind={self.rollout.kind} needs model.kind={want} (got {self.model.kind})"
            )
        lc = self.learner
        if self.workflow is None:
            check_objective(self.rollout.kind, lc.loss, lc.llm, lc.classic)
        else:
            check_no_legacy_knobs(self)
            check_workflow(self.workflow, self.rollout.kind)
        check_agents(self.task, self.learner.policies, self.rollout.kind)
        return self

    @property
    def run_dir(self) -> Path:
        if self.run.dir is None:
            raise ValueError("run.dir is not set (the launcher sets it; roles need it)")
        return Path(self.run.dir)
