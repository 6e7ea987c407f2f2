"""The error every config problem raises, and the one-line form of a validation error (a
module of its own so that validators and plugin loaders anywhere can use them without
importing the loader)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pydantic import ValidationError


class ConfigError(ValueError):
    """A config that cannot be used. The message names the key and what it allows."""


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
