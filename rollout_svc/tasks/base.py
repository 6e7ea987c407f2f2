"""The task interface: a stream of prompts and a reward function (DESIGN section 5).

A task is text in, text out: it writes prompts as text (tokenized with the model's tokenizer)
and scores the decoded completion. Tasks are plugins: subclass `Task`, give it a `Config`
model for its `task.params`, and register it in `rollout_svc.tasks.registry`.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from sluice.config.base import Section
from sluice.wire.messages import Scalar


@dataclass
class Prompt:
    prompt_id: str  # unique within the run (becomes part of the group id)
    text: str  # what the model is given
    reference: Any  # what the reward function checks the completion against


@dataclass
class Score:
    reward: float
    info: dict[str, Scalar] = field(default_factory=dict)


class Task(ABC):
    name: ClassVar[str]
    Config: ClassVar[type[Section]]

    def __init__(self, config: Section, seed: int) -> None:
        self.config = config
        self.rng = random.Random(seed)

    @abstractmethod
    def sample(self, n: int) -> list[Prompt]:
        """The next `n` prompts of the task's stream."""

    @abstractmethod
    def score(self, prompt: Prompt, completion: str, finished: bool) -> Score:
        """Reward of one completion; `finished` is False when it hit max_new_tokens."""

    @abstractmethod
    def vocabulary(self) -> set[str]:
        """Every whitespace-separated token the task writes in prompts or expects in answers."""
