"""Built-in reward functions, in the form every reward function has (rollout_svc/scoring.py):
`fn(prompt, completion, reference, **row) -> float | dict`. Name them in `task.rewards`."""

from __future__ import annotations

from typing import Any

from sluice.rollout_svc.tasks.math_check import extract_answer, math_reward


def math(prompt: Any, completion: str, reference: Any, **row: Any) -> dict[str, float]:
    """The final answer equals the reference by value (math_check.py)."""
    del prompt, row
    reward = math_reward(completion, reference)
    return {"reward": reward, "correct": reward, "answered": float(extract_answer(completion) is not None)}


def exact(prompt: Any, completion: str, reference: Any, **row: Any) -> dict[str, float]:
    """The completion, whitespace-normalised, equals the reference."""
    del prompt, row
    correct = float(" ".join(completion.split()) == " ".join(str(reference).split()))
    return {"reward": correct, "correct": correct}


BUILTIN_REWARDS = {"math": math, "exact": exact}
