"""Load a YAML run config, apply overrides, validate, and report errors in one line.

Precedence, lowest first: the YAML file, environment variables, command-line overrides.

- Command line: dotted keys, `learner.lr=1e-5 rollout.services=1`.
- Environment: `SLUICE__<SECTION>__<KEY>=value`, sections separated by a double underscore,
  case-insensitive (`SLUICE__LEARNER__LR=1e-5`, `SLUICE__WEIGHT_SYNC__MASTER_PORT=29500`,
  `SLUICE__BUFFER__ENDPOINTS='["tcp://buffer-0:5555"]'`). This is the form systemd units,
  Slurm scripts, Kubernetes pods and docker-compose set without touching the file (the same
  convention as pydantic-settings' nested delimiter).

Values are read as YAML in both forms. An error names the key, and the variable when the
value came from the environment.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from sluice.config.errors import ConfigError as ConfigError  # raised by loading; re-exported
from sluice.config.errors import format_validation_error as format_validation_error  # re-exported
from sluice.config.run import RunConfig
from sluice.config.workflow_check import read_workflow_source


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


ENV_PREFIX = "SLUICE__"


def env_overrides(env: Mapping[str, str]) -> list[tuple[list[str], Any, str]]:
    """`SLUICE__LEARNER__LR=1e-5` -> (["learner", "lr"], 1e-05, "SLUICE__LEARNER__LR"), sorted by
    variable name so the result does not depend on the environment's order."""
    out = []
    for name in sorted(env):
        if not name.upper().startswith(ENV_PREFIX):
            continue
        path = [p.lower() for p in name[len(ENV_PREFIX) :].split("__")]
        if not all(path):
            raise ConfigError(f"environment variable {name}: expected SLUICE__SECTION__KEY")
        raw = env[name]
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"{name}: value {raw!r} is not valid YAML ({e})") from None
        out.append((path, value, name))
    return out


def apply_override(tree: dict[str, Any], path: Sequence[str], value: Any, label: str | None = None) -> None:
    """Set `path` in `tree`; a numeric part indexes a list (`workflow.learner.1.loss.clip_high`).
    A workflow given by name or file is read first when a key inside it is overridden."""
    where = label or f"override {'.'.join(path)}"
    if len(path) > 1 and path[0] == "workflow" and isinstance(tree.get("workflow"), str):
        tree["workflow"] = _read_workflow(tree["workflow"], where)
    node: Any = tree
    for i, part in enumerate(path[:-1]):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict):
            node = node.setdefault(part, {})
        else:
            node = None
        if not isinstance(node, dict | list):
            raise ConfigError(f"{where}: {'.'.join(path[: i + 1])} is not a section")
    if isinstance(node, list):
        last = path[-1]
        if not (last.isdigit() and int(last) < len(node)):
            raise ConfigError(f"{where}: {last!r} is not an index of the list")
        node[int(last)] = value
    else:
        node[path[-1]] = value


def _read_workflow(value: str, where: str) -> Any:
    try:
        return read_workflow_source(value)
    except ValueError as e:
        raise ConfigError(f"{where}: workflow: {e}") from None


def config_from_dict(tree: dict[str, Any], sources: Mapping[str, str] | None = None) -> RunConfig:
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(f"config error: {format_validation_error(e, sources)}") from None


def load_config(
    path: str | Path | None, overrides: Sequence[str] = (), env: Mapping[str, str] | None = None
) -> RunConfig:
    """The file, then `SLUICE__...` variables of `env` (None: no environment), then `overrides`."""
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
    sources: dict[str, str] = {}
    for keys, value, name in env_overrides(env or {}):
        apply_override(tree, keys, value, label=name)
        sources[".".join(keys)] = name
    for text in overrides:
        keys, value = parse_override(text)
        apply_override(tree, keys, value)
        sources.pop(".".join(keys), None)
    return config_from_dict(tree, sources)


def dump_config(cfg: RunConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
