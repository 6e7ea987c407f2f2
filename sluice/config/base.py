"""Base class of every config section: strict, documented, validated at load time."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section. Unknown keys are errors (a typo must not silently fall back to a
    default); each field's docstring is its documentation (`sluice config --help` prints it)."""

    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        use_attribute_docstrings=True,
    )
