"""Verifiable digit-string tasks for tiny models: copy and reverse.

Prompt: `3 1 4 =`. Copy expects `3 1 4` then end-of-sequence; reverse expects `4 1 3`.
Reward is partial credit in [0, 1]: one point per position with the right digit and one for
stopping right after the last digit, divided by length + 1. A random tiny model scores about
0.07; a policy that solved the task scores 1.0.
"""

from __future__ import annotations

import random

from pydantic import Field

from sluice.config.base import Section
from sluice.rollout_svc.tasks.base import Prompt, Score, Task

DIGITS = [str(d) for d in range(10)]


class DigitsConfig(Section):
    """`task.params` of copy and reverse."""

    length: int = Field(default=3, ge=1, le=32)
    """Digits per prompt (and per expected answer)."""


class CopyTask(Task[DigitsConfig]):
    """Copy the prompt's digits; held-out strings are never sampled for training."""

    name = "copy"
    Config = DigitsConfig

    def __init__(self, config: DigitsConfig, seed: int) -> None:
        super().__init__(config, seed)
        self._count = 0
        self._held: set[tuple[str, ...]] = set()  # held-out strings, never sampled for training

    def target(self, digits: list[str]) -> list[str]:
        return digits

    def sample(self, n: int) -> list[Prompt]:
        out = []
        while len(out) < n:
            digits = [self.rng.choice(DIGITS) for _ in range(self.config.length)]
            if tuple(digits) in self._held:
                continue
            self._count += 1
            out.append(Prompt(f"p{self._count}", " ".join(digits) + " =", self.target(digits)))
        return out

    def held_out(self, n: int) -> list[Prompt]:
        """`n` distinct strings from a fixed seed (the same for every service), at most a
        quarter of all 10**length; `sample` never draws them from then on."""
        n = min(n, 10**self.config.length // 4)
        rng, chosen = random.Random(104729), []
        while len(chosen) < n:
            digits = tuple(rng.choice(DIGITS) for _ in range(self.config.length))
            if digits not in chosen:
                chosen.append(digits)
        self._held = set(chosen)
        return [Prompt(f"eval{i}", " ".join(d) + " =", self.target(list(d))) for i, d in enumerate(chosen)]

    def score(self, prompt: Prompt, completion: str, finished: bool) -> Score:
        return copy_credit(prompt.reference, completion, finished)

    def vocabulary(self) -> set[str]:
        return {*DIGITS, "="}


class ReverseTask(CopyTask):
    name = "reverse"

    def target(self, digits: list[str]) -> list[str]:
        return digits[::-1]


def copy_credit(target: list[str], completion: str, finished: bool) -> Score:
    """Partial credit for writing `target` (module docstring); `exact` when all of it is right."""
    words = completion.split()
    correct = sum(1 for a, b in zip(words, target) if a == b)
    stopped_right = finished and len(words) == len(target)
    reward = (correct + int(stopped_right)) / (len(target) + 1)
    return Score(reward, {"exact": float(correct == len(target) and stopped_right)})
