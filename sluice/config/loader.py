"""Load a YAML run config, apply dotted overrides, validate, and report errors in one line."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from sluice.config.run import RunConfig


class ConfigError(ValueError):
    """A config that cannot be used. The message names the key and what it allows."""


def parse_override(text: str) -> tuple[list[str], Any]:
    """`learner.lr=1e-5` -> (["learner", "lr"], 1e-05). The value is read as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key.path=value")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {key}: value {raw!r} is not valid YAML ({e})") from None
    return path, value


def apply_override(tree: dict[str, Any], path: Sequence[str], value: Any) -> None:
    node = tree
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {'.'.join(path)}: {'.'.join(path[: i + 1])} is not a section")
        node = child
    node[path[-1]] = value


def format_validation_error(err: ValidationError) -> str:
    """One line per problem: `learner.loss.type: Input should be 'grpo' (got 'foo')`."""
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown key")
            continue
        got = e.get("input")
        got_text = "" if isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"{where}: {e['msg']}{got_text}")
    return "; ".join(lines)


def config_from_dict(tree: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(f"config error: {format_validation_error(e)}") from None


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> RunConfig:
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r}: top level must be a mapping")
        tree = loaded or {}
    for text in overrides:
        keys, value = parse_override(text)
        apply_override(tree, keys, value)
    return config_from_dict(tree)


def dump_config(cfg: RunConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
