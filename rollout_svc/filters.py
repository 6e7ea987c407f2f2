"""The rollout half of a workflow: group filters applied after scoring (`workflow.rollout`,
sluice/config/workflow.py). A dropped group never reaches the buffer; the actor loop gives its
quota back."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sluice.config.workflow import DropZeroVariance
from sluice.plugins import UserCodeError, resolve_function
from sluice.rollout_svc.episodes import Sample

GroupFilter = Callable[[list[Sample]], bool]


def drop_zero_variance(spread: float) -> GroupFilter:
    """DAPO's dynamic sampling: keep a group whose rewards differ (a group of one is kept)."""

    def keep(group: list[Sample]) -> bool:
        rewards = [s.reward for s in group]
        return len(group) < 2 or max(rewards) - min(rewards) > spread

    return keep


def user_filter(fn: Any, params: Any, key: str) -> GroupFilter:
    """A user's `fn(samples, params) -> bool`; one that raises or returns a non-bool stops the
    service (exit code 3: a restart would do the same)."""

    def keep(group: list[Sample]) -> bool:
        try:
            out = fn(group, params)
        except Exception as e:
            raise UserCodeError(f"{key}: the filter raised {type(e).__name__}: {e}") from e
        if not isinstance(out, bool):
            raise UserCodeError(f"{key}: the filter returned a {type(out).__name__}, not a bool")
        return out

    return keep


def build_filters(stages: Sequence[Any]) -> list[GroupFilter]:
    out: list[GroupFilter] = []
    for i, st in enumerate(stages):
        if isinstance(st, DropZeroVariance):
            out.append(drop_zero_variance(st.min_spread))
            continue
        key = f"workflow.rollout[{i}].stage"
        fn, params = resolve_function(
            st.stage, "stages", key, st.params, ("workflow", "rollout", str(i), "params")
        )
        out.append(user_filter(fn, params, key))
    return out
