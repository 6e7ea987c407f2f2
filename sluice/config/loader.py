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
from sluice.config.run import RunConfig


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
    node = tree
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = label or f"override {'.'.join(path)}"
            raise ConfigError(f"{where}: {'.'.join(path[: i + 1])} is not a section")
        node = child
    node[path[-1]] = value


def format_validation_error(
    err: ValidationError, sources: Mapping[str, str] | None = None, prefix: Sequence[str] = ()
) -> str:
    """One line per problem: `learner.loss.clip_high: unknown key for learner.loss.type=grpo`.
    `sources` maps a dotted key to where its value came from (an environment variable);
    `prefix` is the key of the section `err` is about (a plugin's own params)."""
    lines = []
    for e in err.errors():
        where, tag = _key([*prefix, *e["loc"]])
        source = _source_of(where, sources or {})
        if e["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown key{f' for {tag}' if tag else ''}{source}")
            continue
        got = e.get("input")
        got_text = "" if isinstance(got, dict) else f" (got {got!r})"
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{where + ': ' if where else ''}{msg}{got_text}{source}")
    return "; ".join(lines)


def _key(loc: Sequence[str | int]) -> tuple[str, str | None]:
    """(dotted key, tag) of an error location. A part such as `type=grpo` is the tag of a
    tagged union (sluice/config/loss.py), not a key: it says which member the key is in, and
    is given with the key above it (`learner.loss.type=grpo`)."""
    parts = [str(p) for p in loc]
    keys = [p for p in parts if "=" not in p]
    tags = [i for i, p in enumerate(parts) if "=" in p]
    if not tags:
        return ".".join(keys), None
    above = [p for p in parts[: tags[-1]] if "=" not in p]
    return ".".join(keys), ".".join([*above, parts[tags[-1]]])


def _source_of(where: str, sources: Mapping[str, str]) -> str:
    """The variable that set `where` or a section above it, as ` [from NAME]`."""
    parts = where.split(".")
    for n in range(len(parts), 0, -1):
        name = sources.get(".".join(parts[:n]))
        if name is not None:
            return f" [from {name}]"
    return ""


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
