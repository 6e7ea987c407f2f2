"""Verifiable digit-string tasks for tiny models: copy and reverse.

Prompt: `3 1 4 =`. Copy expects `3 1 4` then end-of-sequence; reverse expects `4 1 3`.
Reward is partial credit in [0, 1]: one point per position with the right digit and one for
stopping right after the last digit, divided by length + 1. A random tiny model scores about
0.07; a policy that solved the task scores 1.0.
"""

from __future__ import annotations

from pydantic import Field

from sluice.config.base import Section
from sluice.rollout_svc.tasks.base import Prompt, Score, Task

DIGITS = [str(d) for d in range(10)]


class DigitsConfig(Section):
    length: int = Field(default=3, ge=1, le=32)
    """Digits per prompt (and per expected answer)."""


class CopyTask(Task):
    name = "copy"
    Config = DigitsConfig
    config: DigitsConfig  # the instance of Config that __init__ is given

    def __init__(self, config: DigitsConfig, seed: int) -> None:
        super().__init__(config, seed)
        self._count = 0

    def target(self, digits: list[str]) -> list[str]:
        return digits

    def sample(self, n: int) -> list[Prompt]:
        out = []
        for _ in range(n):
            digits = [self.rng.choice(DIGITS) for _ in range(self.config.length)]
            self._count += 1
            out.append(Prompt(f"p{self._count}", " ".join(digits) + " =", self.target(digits)))
        return out

    def score(self, prompt: Prompt, completion: str, finished: bool) -> Score:
        target: list[str] = prompt.reference
        words = completion.split()
        correct = sum(1 for a, b in zip(words, target) if a == b)
        stopped_right = finished and len(words) == len(target)
        reward = (correct + int(stopped_right)) / (len(target) + 1)
        return Score(reward, {"exact": float(correct == len(target) and stopped_right)})

    def vocabulary(self) -> set[str]:
        return {*DIGITS, "="}


class ReverseTask(CopyTask):
    name = "reverse"

    def target(self, digits: list[str]) -> list[str]:
        return digits[::-1]
