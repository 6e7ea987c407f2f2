"""A user's loss by reference: resolve `learner.loss.type` and validate `learner.loss.params`
(docs/architecture.md, "Objectives and losses"; the interface is in learner/losses/base.py).

Kept free of torch so that the launcher's pre-flight check (`check_loss`, called by
sluice/cli.py before any process starts) costs nothing when the loss is a built-in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError

from sluice.config.errors import ConfigError
from sluice.config.loader import format_validation_error
from sluice.config.loss import BUILTIN_LOSSES, CustomLoss, LossConfig
from sluice.plugins import PluginError, resolve

KEY = "learner.loss.type"


def load_custom_loss(cfg: CustomLoss) -> tuple[Callable[..., Any], Any]:
    """(the loss function `cfg.type` names, its params: `Params`-validated, or the dict).
    Raises a one-line `ConfigError` naming the key."""
    fn = resolve(cfg.type, "losses", KEY, dict.fromkeys(BUILTIN_LOSSES))
    if isinstance(fn, type) or not callable(fn):
        what = f"the class {fn.__name__}" if isinstance(fn, type) else f"a {type(fn).__name__}"
        raise PluginError(
            f"config error: {KEY}: {cfg.type!r} is {what}; a loss is a function or an object "
            "with __call__(inputs, params)"
        )
    model = getattr(fn, "Params", None)
    if model is None:
        return fn, dict(cfg.params)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise PluginError(f"config error: {KEY}: {cfg.type!r}: its Params is not a pydantic model")
    try:
        return fn, model.model_validate(cfg.params)
    except ValidationError as e:
        raise ConfigError(
            f"config error: {format_validation_error(e, prefix=('learner', 'loss', 'params'))}"
        ) from None


def check_loss(loss: LossConfig) -> None:
    """The launcher's pre-flight: a custom loss resolves and its params validate."""
    if isinstance(loss, CustomLoss):
        load_custom_loss(loss)
