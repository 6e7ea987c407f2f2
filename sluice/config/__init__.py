"""Typed run configuration: one section per component, loaded from YAML with dotted overrides."""

from sluice.config.buffer import BufferConfig
from sluice.config.control import ControlConfig
from sluice.config.env import EnvConfig
from sluice.config.learner import GroupPorts, LearnerConfig
from sluice.config.loader import ConfigError, dump_config, load_config
from sluice.config.loss import (
    ClassicObjectiveConfig,
    CustomLoss,
    DecoupledPPOLoss,
    GrpoLoss,
    LLMObjectiveConfig,
    LossConfig,
    PPOLoss,
    VTraceLoss,
    parse_loss,
)
from sluice.config.model import MLPModelInit, ModelConfig, TinyModelInit
from sluice.config.ray import RayConfig, RoleResources
from sluice.config.rollout import RolloutConfig
from sluice.config.run import MetricsConfig, RunConfig, RunSection
from sluice.config.security import SecurityConfig
from sluice.config.task import TaskConfig
from sluice.config.weight_sync import WeightSyncConfig

__all__ = [
    "BufferConfig",
    "ClassicObjectiveConfig",
    "ConfigError",
    "ControlConfig",
    "CustomLoss",
    "DecoupledPPOLoss",
    "EnvConfig",
    "GroupPorts",
    "GrpoLoss",
    "LLMObjectiveConfig",
    "LearnerConfig",
    "LossConfig",
    "MLPModelInit",
    "MetricsConfig",
    "ModelConfig",
    "PPOLoss",
    "RayConfig",
    "RoleResources",
    "RolloutConfig",
    "RunConfig",
    "RunSection",
    "SecurityConfig",
    "TaskConfig",
    "TinyModelInit",
    "VTraceLoss",
    "WeightSyncConfig",
    "dump_config",
    "load_config",
    "parse_loss",
]
