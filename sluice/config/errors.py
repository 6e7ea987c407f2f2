"""The error every config problem raises (a module of its own so that validators anywhere in
the config can raise it without importing the loader)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config that cannot be used. The message names the key and what it allows."""
