"""The task interface: a stream of prompts and a reward function.

A task is text in, text out: it writes prompts as text (tokenized with the model's tokenizer)
and scores the decoded completion. Tasks are plugins: subclass `Task` (single turn) or
`MultiTurnTask` (the environment replies, the model continues), give it a `Config` model for
its `task.params`, and name it in `task.name` by reference or entry point (docs/extending.md).

Single turn: `sample(n)` prompts, the engine completes each `group_size` times, `score` gives
each completion its reward (or the reward functions of `task.rewards` do: scoring.py).

Multi turn: `start(prompt)` opens an `Episode` per completion; after each model turn the
episode's `respond` either replies (its text is appended to the context; those tokens are not
the model's and get loss_mask 0) or ends the episode with its reward. Tool-call style tasks
are episodes whose replies are tool results (see `tasks/calculator.py`).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from sluice.config.base import Section
from sluice.wire.messages import Scalar


@dataclass
class Prompt:
    prompt_id: str  # unique within the service (becomes part of the group id)
    text: str  # what the model is given (the content of the last user message for chats)
    reference: Any  # what the reward function checks the completion against
    messages: list[dict[str, str]] | None = None  # a chat: rendered by the tokenizer's chat template
    row: dict[str, Any] = field(default_factory=dict)  # the row's other columns, for reward functions


@dataclass
class Score:
    reward: float
    info: dict[str, Scalar] = field(default_factory=dict)


ConfigT = TypeVar("ConfigT", bound=Section)


class Task(ABC, Generic[ConfigT]):
    """Subclass as `class MyTask(Task[MyConfig])` with `Config = MyConfig`: `self.config` is then
    typed as the `task.params` model `Config` validated."""

    name: ClassVar[str]  # in messages and metrics; default: the class name
    Config: ClassVar[type[Section]]
    multi_turn: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            cls.name = cls.__name__

    def __init__(self, config: ConfigT, seed: int) -> None:
        self.config = config
        self.rng = random.Random(seed)

    @abstractmethod
    def sample(self, n: int) -> list[Prompt]:
        """The next `n` prompts of the task's stream."""

    def held_out(self, n: int) -> list[Prompt]:
        """`n` evaluation prompts, the same on every call and kept out of `sample`'s stream
        where the task can (`task.eval`). Default: none (evaluation is a config error)."""
        raise NotImplementedError(f"task {self.name!r} has no held-out prompts")

    @abstractmethod
    def score(self, prompt: Prompt, completion: str, finished: bool) -> Score:
        """Reward of one completion; `finished` is False when it hit its token budget."""

    def vocabulary(self) -> set[str]:
        """Every whitespace-separated token the task writes in prompts or expects in answers:
        checked against a word-level tokenizer (model.init) at start. A task for a real
        tokenizer may leave it empty."""
        return set()


@dataclass
class EnvReply:
    """What the environment answers to one model turn."""

    text: str | None  # appended to the context, the model continues; None ends the episode
    reward: float = 0.0  # the episode's reward (read when it ends)
    info: dict[str, Scalar] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.text is None


class Episode(ABC):
    """One multi-turn interaction; holds whatever state the environment needs."""

    @abstractmethod
    def respond(self, model_text: str, finished: bool) -> EnvReply:
        """The model's latest turn (decoded, `finished` False if cut at its budget) -> reply."""

    @abstractmethod
    def cut_short(self) -> EnvReply:
        """The episode ran out of turns or context before it ended: its final reply."""


class MultiTurnTask(Task[ConfigT]):
    multi_turn: ClassVar[bool] = True
    max_turns: int  # model turns per episode at most

    @abstractmethod
    def start(self, prompt: Prompt) -> Episode:
        """A fresh episode for one completion of `prompt`."""

    def score(self, prompt: Prompt, completion: str, finished: bool) -> Score:
        raise TypeError(f"{self.name} is multi-turn: its episodes give the rewards")
