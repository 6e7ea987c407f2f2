"""A single-turn task: the prompt is digits, the answer is the first of them.

`3 1 4 =` expects `3` and then end-of-sequence. Its own score (used when `task.rewards` is
empty) is 1 for exactly that; the reward functions in `rewards.py` split it into two parts.
"""

from __future__ import annotations

import itertools
import random

from pydantic import Field

from sluice.config.base import Section
from sluice.rollout_svc.tasks.base import Prompt, Score, Task

DIGITS = "0123456789"


class FirstDigitConfig(Section):
    length: int = Field(default=3, ge=1, le=16)
    """Digits per prompt."""


class FirstDigitTask(Task[FirstDigitConfig]):
    """Registered as the `first_digit` entry point of `sluice.tasks` (pyproject.toml)."""

    Config = FirstDigitConfig  # validates task.params; an instance becomes self.config
    name = "first_digit"

    def __init__(self, config: FirstDigitConfig, seed: int) -> None:
        super().__init__(config, seed)
        self._ids = itertools.count()

    def _prompt(self, prompt_id: str, rng: random.Random) -> Prompt:
        digits = [rng.choice(DIGITS) for _ in range(self.config.length)]
        return Prompt(prompt_id, " ".join(digits) + " =", digits[0], row={"length": len(digits)})

    def sample(self, n: int) -> list[Prompt]:
        return [self._prompt(f"f{next(self._ids)}", self.rng) for _ in range(n)]

    def held_out(self, n: int) -> list[Prompt]:
        rng = random.Random(7)
        return [self._prompt(f"eval{i}", rng) for i in range(n)]

    def score(self, prompt: Prompt, completion: str, finished: bool) -> Score:
        correct = finished and completion.split() == [prompt.reference]
        return Score(float(correct), {"exact": float(correct)})

    def vocabulary(self) -> set[str]:
        return {*DIGITS, "="}
