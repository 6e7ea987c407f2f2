"""A user's loss by reference: resolve `learner.loss.type` and validate `learner.loss.params`
(docs/architecture.md, "Objectives and losses"; the interface is in learner/losses/base.py).

Kept free of torch so that the launcher's pre-flight check (`check_loss`, called by
sluice/cli.py before any process starts) costs nothing when the loss is a built-in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sluice.config.loss import BUILTIN_LOSSES, CustomLoss, LossConfig
from sluice.plugins import PluginError, resolve_function

KEY = "learner.loss.type"


def load_custom_loss(cfg: CustomLoss, key: str = KEY) -> tuple[Callable[..., Any], Any]:
    """(the loss function `cfg.type` names, its params: `Params`-validated, or the dict).
    Raises a one-line `ConfigError` naming the key."""
    if cfg.type in BUILTIN_LOSSES:
        raise PluginError(f"config error: {key}: {cfg.type!r} is a built-in loss, not a reference")
    params_key = (*key.split(".")[:-1], "params")
    return resolve_function(cfg.type, "losses", key, cfg.params, params_key)


def check_loss(loss: LossConfig) -> None:
    """The launcher's pre-flight: a custom loss resolves and its params validate."""
    if isinstance(loss, CustomLoss):
        load_custom_loss(loss)
