"""Plugins by reference: one resolver for every config key that picks an implementation.

A reference is, tried in this order:

1. a built-in name (`copy`, `hf`, `grpo`, ...), given by the caller;
2. a name that an installed package registers under the entry-point group `sluice.<group>`
   (`[project.entry-points."sluice.tasks"] my_task = "my_pkg.tasks:MyTask"`);
3. `package.module:attr` (importable from the role's `sys.path`);
4. `path/to/file.py:attr` (a relative path is taken from the working directory; the config
   loader makes it absolute, so every role of a run loads the same file).

A reference that does not resolve raises `PluginError`, a `ConfigError` whose one line names
the config key, the reference and the import error. The rules for each kind of plugin
(what a task, reward, engine or loss must be) are in docs/extending.md.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Mapping, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ValidationError

from sluice.config.errors import ConfigError, format_validation_error

GROUPS = ("tasks", "rewards", "engines", "losses", "envs", "stages")


class PluginError(ConfigError):
    """A reference in the config that names nothing usable."""


class UserCodeError(RuntimeError):
    """A user's plugin failed while the run was going, in a way a restart would repeat (a
    reward that raises under `on_error: fail`). Roles exit with EXIT_USER_CODE and launchers
    do not restart them."""


def is_reference(text: str) -> bool:
    """True for `module:attr` and `file.py:attr` (a colon is never part of a built-in name)."""
    return ":" in text


def is_file_reference(text: str) -> bool:
    return is_reference(text) and text.rsplit(":", 1)[0].endswith(".py")


def absolute_reference(text: str, base: Path | None = None) -> str:
    """A file reference with its path made absolute (from `base`, default the working
    directory); anything else unchanged."""
    if not is_file_reference(text):
        return text
    path, attr = text.rsplit(":", 1)
    return f"{((base or Path.cwd()) / Path(path).expanduser()).resolve()}:{attr}"


PluginRef = Annotated[str, AfterValidator(absolute_reference)]
"""A config field holding a reference (file references made absolute when the config loads)."""


def resolve(ref: str, group: str, key: str, builtins: Mapping[str, Any] | None = None) -> Any:
    """What `ref` (the value of config key `key`) names: a built-in, an entry point of
    `sluice.<group>`, or an attribute of a module or file."""
    if group not in GROUPS:
        raise ValueError(f"plugin group {group!r} is not one of {GROUPS}")
    builtins = builtins or {}
    if ref in builtins:
        return builtins[ref]
    if not is_reference(ref):
        registered = _entry_points(group)
        if ref in registered:
            try:
                return registered[ref].load()
            except Exception as e:  # whatever the package's import raises
                raise _error(key, ref, f"entry point sluice.{group} fails to load: {_describe(e)}") from None
        known = sorted({*builtins, *registered})
        raise _error(
            key,
            ref,
            f"not a built-in or registered name (known: {known}); "
            "a plugin is `package.module:attr` or `path/to/file.py:attr`",
        )
    where, attr = ref.rsplit(":", 1)
    module = _load_file(where, key, ref) if where.endswith(".py") else _load_module(where, key, ref)
    try:
        obj: Any = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise _error(key, ref, f"{where} has no attribute {attr!r}") from None
    return obj


def resolve_function(
    ref: str, group: str, key: str, params: Mapping[str, Any], params_key: Sequence[str]
) -> tuple[Any, Any]:
    """(the function `ref` names, `params` validated by its `Params` pydantic model, or as a
    dict when it has none). Raises a one-line `ConfigError` naming `key` or `params_key`."""
    fn = resolve(ref, group, key)
    if isinstance(fn, type) or not callable(fn):
        what = f"the class {fn.__name__}" if isinstance(fn, type) else f"a {type(fn).__name__}"
        noun = group.removesuffix("es") if group == "losses" else group.removesuffix("s")
        raise _error(key, ref, f"is {what}; a {noun} is a function or an object with __call__")
    model = getattr(fn, "Params", None)
    if model is None:
        return fn, dict(params)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise _error(key, ref, "its Params is not a pydantic model")
    try:
        return fn, model.model_validate(params)
    except ValidationError as e:
        raise ConfigError(f"config error: {format_validation_error(e, prefix=tuple(params_key))}") from None


def _entry_points(group: str) -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=f"sluice.{group}")}


def _load_module(name: str, key: str, ref: str) -> Any:
    try:
        return importlib.import_module(name)
    except Exception as e:  # ImportError, or whatever the module raises while importing
        raise _error(key, ref, f"cannot import {name}: {_describe(e)}") from None


def _load_file(where: str, key: str, ref: str) -> Any:
    """Import a .py file once per process, under a name derived from its absolute path (so two
    references to the same file give the same classes)."""
    path = Path(where).expanduser().resolve()
    if not path.is_file():
        raise _error(key, ref, f"no file {str(path)!r}")
    name = f"sluice_plugin_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise _error(key, ref, f"cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise _error(key, ref, f"importing {path.name} raised {_describe(e)}") from None
    return module


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0]


def _error(key: str, ref: str, why: str) -> PluginError:
    return PluginError(f"config error: {key}: {ref!r}: {why}")
