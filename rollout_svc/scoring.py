"""Scoring completions: the task's own score or the reward functions of `task.rewards`, run in a
bounded pool with deadlines (calls.py), with `task.scoring.on_error` deciding what a call that
raises or times out does. Never a silent zero: every failure is counted, and logged with its
traceback (docs/extending.md, Rewards).

A reward function is `fn(prompt, completion, reference, **row) -> float | dict[str, float]`
(sync or `async def`): `prompt` is what the model was given (text, or the chat messages),
`row` the dataset row's other columns (plus `finished`, False when the completion hit its
token budget, for a function that names it). A dict's `reward` key is the reward; its other
keys are logged as metrics. A function that takes no `**kwargs` is given only the columns it
names.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.config.errors import ConfigError
from sluice.config.task import ScoringConfig, TaskConfig
from sluice.plugins import UserCodeError, resolve
from sluice.rollout_svc.calls import Call, CallPool, CallResult
from sluice.rollout_svc.tasks.base import Prompt, Score, Task
from sluice.rollout_svc.tasks.rewards import BUILTIN_REWARDS
from sluice.wire.messages import Scalar

log = logging.getLogger(__name__)


class RewardError(UserCodeError):
    """A reward call failed and `task.scoring.on_error` is `fail`: the service stops."""


@dataclass(frozen=True)
class ToScore:
    prompt: Prompt
    completion: str
    finished: bool


@dataclass(frozen=True)
class RewardFn:
    name: str
    fn: Callable[..., Any]
    weight: float
    accepts: frozenset[str] | None  # keyword arguments it takes beyond the three; None: any

    def call(self, item: ToScore) -> Call:
        extra = {**item.prompt.row, "finished": item.finished}
        if self.accepts is not None:
            extra = {k: v for k, v in extra.items() if k in self.accepts}
        prompt = item.prompt.messages if item.prompt.messages is not None else item.prompt.text
        given = {"prompt": prompt, "completion": item.completion, "reference": item.prompt.reference}
        return Call(self.fn, {**extra, **given}, inline=self.fn in BUILTIN_REWARDS.values())


@dataclass(frozen=True)
class TaskScore:
    """The task's own `score`, run like a reward function (same pool, deadline, on_error)."""

    task: Task
    name: str = "score"
    weight: float = 1.0

    def call(self, item: ToScore) -> Call:
        builtin = type(self.task).__module__.startswith("sluice.rollout_svc.tasks.")
        return Call(self.task.score, {}, (item.prompt, item.completion, item.finished), inline=builtin)


def build_rewards(cfg: TaskConfig, task: Task) -> list[RewardFn]:
    """`task.rewards` resolved (built-ins, entry points `sluice.rewards`, references)."""
    if task.multi_turn and cfg.rewards:
        raise ConfigError(
            f"config error: task.rewards: {task.name!r} is multi-turn: its episodes give rewards"
        )
    out = []
    for i, r in enumerate(cfg.rewards):
        fn = resolve(r.fn, "rewards", f"task.rewards.{i}.fn", BUILTIN_REWARDS)
        if not callable(fn):
            raise ConfigError(
                f"config error: task.rewards.{i}.fn: {r.fn!r} is a {type(fn).__name__}, not a function"
            )
        out.append(RewardFn(r.name or getattr(fn, "__name__", f"reward{i}"), fn, r.weight, _accepts(fn)))
    return out


def _accepts(fn: Callable[..., Any]) -> frozenset[str] | None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: hand it everything
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params) - {"prompt", "completion", "reference"}


Scorable = RewardFn | TaskScore


@dataclass
class ScoredBatch:
    """Scores per group (None: the group is skipped) and what went wrong on the way."""

    groups: list[list[Score] | None]
    errors: int = 0  # calls that raised
    timeouts: int = 0  # calls past their deadline
    components: dict[str, list[float]] = field(default_factory=dict)  # metric -> values

    @property
    def skipped_groups(self) -> int:
        return sum(g is None for g in self.groups)


class Scorer:
    """Scores whole groups at once, so slow calls overlap (a sandbox, an HTTP checker)."""

    def __init__(self, task: Task, cfg: TaskConfig) -> None:
        self.task = task
        self.rewards = build_rewards(cfg, task)
        self.cfg: ScoringConfig = cfg.scoring
        self.pool = CallPool(cfg.scoring.workers, cfg.scoring.timeout_s)

    def score(self, groups: Sequence[Sequence[ToScore]]) -> ScoredBatch:
        fns: Sequence[Scorable] = self.rewards or [TaskScore(self.task)]
        items = [item for g in groups for item in g]
        results = self.pool.run([f.call(item) for item in items for f in fns])
        batch = ScoredBatch([])
        k = 0
        for g in groups:
            scores: list[Score] | None = []
            for item in g:
                score = self._combine(item, fns, results[k : k + len(fns)], batch)
                k += len(fns)
                if score is None or scores is None:
                    scores = None
                else:
                    scores.append(score)
            batch.groups.append(scores)
        return batch

    def _combine(
        self, item: ToScore, fns: Sequence[Scorable], results: list[CallResult], batch: ScoredBatch
    ) -> Score | None:
        """One sample's score from its calls; None: a call failed and the group is skipped."""
        reward, info = 0.0, {}
        for f, res in zip(fns, results):
            value, part = self._value(f, item, res, batch)
            if value is None:
                return None
            reward += f.weight * value
            info.update(part)
        return Score(reward, info)

    def _value(
        self, f: Scorable, item: ToScore, res: CallResult, batch: ScoredBatch
    ) -> tuple[float | None, dict[str, Scalar]]:
        if res.status == "ok":
            try:
                value, info = _read(f, res.value)
            except (TypeError, ValueError) as e:
                res = CallResult("error", error=f"{e}\n")
            else:
                for key, v in info.items():
                    if isinstance(v, int | float) and not isinstance(v, bool):
                        batch.components.setdefault(key, []).append(float(v))
                return value, info
        return self._failed(f, item, res, batch), {}

    def _failed(self, f: Scorable, item: ToScore, res: CallResult, batch: ScoredBatch) -> float | None:
        what = f"reward {f.name!r} on prompt {item.prompt.prompt_id}"
        if res.status == "timeout":
            batch.timeouts += 1
            message = f"{what} timed out: {res.error}"
        else:
            batch.errors += 1
            message = f"{what} raised:\n{res.error.rstrip()}"
        if self.cfg.on_error == "fail":
            raise RewardError(f"{message}\n(task.scoring.on_error=fail; skip_group or zero go on)")
        log.warning("%s (task.scoring.on_error=%s)", message, self.cfg.on_error)
        return 0.0 if self.cfg.on_error == "zero" else None

    def close(self) -> None:
        self.pool.close()


def _read(f: Scorable, value: Any) -> tuple[float, dict[str, Scalar]]:
    """A reward function's result as (reward, metrics); a Score is a task's own."""
    if isinstance(value, Score):
        return value.reward, dict(value.info)
    if isinstance(value, dict):
        if "reward" not in value:
            raise ValueError(f"reward {f.name!r} returned a dict without a 'reward' key: {sorted(value)}")
        rest = {k: v for k, v in value.items() if k != "reward"}
        return _number(f, value["reward"]), {f"reward_{f.name}": _number(f, value["reward"]), **rest}
    number = _number(f, value)
    return number, {f"reward_{f.name}": number}


def _number(f: Scorable, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"reward {f.name!r} returned {type(value).__name__} {value!r}, not a number")
    if not math.isfinite(value):
        raise ValueError(f"reward {f.name!r} returned {value}, not a finite number")
    return float(value)
