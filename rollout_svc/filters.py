"""The rollout half of a workflow: group filters applied after scoring (`workflow.rollout`,
sluice/config/workflow.py). A dropped group never reaches the buffer; the actor loop gives its
quota back."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from sluice.config.workflow import DropZeroVariance
from sluice.plugins import UserCodeError, resolve_function
from sluice.rollout_svc.episodes import Sample

GroupFilter = Callable[[list[Sample]], bool]
log = logging.getLogger(__name__)


class ZeroVarianceFilter:
    """DAPO's dynamic sampling: keeps a group whose rewards differ (a group of one is kept), and
    after `keep_after` groups in a row dropped, the next one, so that a solved task (every group
    scoring the same) does not starve the learner; `passed` counts those."""

    def __init__(self, spread: float, keep_after: int | None, service_id: str = "") -> None:
        self.spread, self.keep_after, self.service_id = spread, keep_after, service_id
        self.streak = 0  # groups dropped in a row
        self.passed = 0

    def __call__(self, group: list[Sample]) -> bool:
        rewards = [s.reward for s in group]
        if len(group) < 2 or max(rewards) - min(rewards) > self.spread:
            self.streak = 0
            return True
        if self.keep_after is None or self.streak < self.keep_after:
            self.streak += 1
            return False
        self.streak = 0
        self.passed += 1
        if self.passed == 1:
            log.warning(
                "%s: %d groups in a row scored alike (within min_spread; the last near %g): keeping "
                "one of every %d so the learner is not starved (its advantages are zero). Every "
                "group scoring the same means the task is solved or gives no signal.",
                self.service_id or "rollout", self.keep_after, rewards[0], self.keep_after + 1,
            )  # fmt: skip
        return True


class Oversampler:
    """How many prompts a service generates for a grant of `n` groups while filters drop some:
    `n` over the share it has kept lately (a moving average over batches), plus one, at most
    `most` times `n`. Without it a call that came up short left the rest of the grant to a
    second call of a few groups, a whole decode loop of its own (docs/architecture.md, "Groups,
    filters, lengths")."""

    def __init__(self, most: float, weight: float = 0.25) -> None:
        self.most, self.weight = most, weight
        self.keep_rate: float | None = None  # None until a batch is seen; the first one's share outright

    def prompts(self, n: int) -> int:
        if self.most <= 1.0 or self.keep_rate is None or self.keep_rate >= 1.0:
            return n
        most = math.floor(n * self.most)
        if self.keep_rate * most <= n:  # (nothing kept lately: a keep rate of 0 asks the most)
            return most
        return min(round(n / self.keep_rate) + 1, most)

    def observe(self, live: int, kept: int) -> None:
        """A batch's groups: `live` scored, `kept` of them passed every filter."""
        if live:
            share = kept / live
            self.keep_rate = (
                share if self.keep_rate is None else self.keep_rate + self.weight * (share - self.keep_rate)
            )


def oversampler(stages: Sequence[Any]) -> Oversampler:
    """The workflow's limit: DAPO's filter's `oversample` (1, none, without that filter)."""
    return Oversampler(max([st.oversample for st in stages if isinstance(st, DropZeroVariance)], default=1.0))


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


def build_filters(stages: Sequence[Any], service_id: str = "") -> list[GroupFilter]:
    out: list[GroupFilter] = []
    for i, st in enumerate(stages):
        if isinstance(st, DropZeroVariance):
            out.append(ZeroVarianceFilter(st.min_spread, st.keep_after, service_id))
            continue
        key = f"workflow.rollout[{i}].stage"
        fn, params = resolve_function(
            st.stage, "stages", key, st.params, ("workflow", "rollout", str(i), "params")
        )
        out.append(user_filter(fn, params, key))
    return out
