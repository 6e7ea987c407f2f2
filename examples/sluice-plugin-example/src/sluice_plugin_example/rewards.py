"""Two reward functions in the form every Sluice reward has:
`fn(prompt, completion, reference, **row) -> float | dict[str, float]`."""

from __future__ import annotations

import asyncio
from typing import Any


def first_digit_right(prompt: str, completion: str, reference: str, **row: Any) -> dict[str, float]:
    """1 when the completion starts with the reference digit; logs how long the prompt was."""
    words = completion.split()
    return {"reward": float(bool(words) and words[0] == reference), "prompt_digits": float(row["length"])}


async def stops_after_one(prompt: str, completion: str, reference: str, finished: bool) -> float:
    """1 when the model wrote one word and stopped. Async, as a checker that awaits a
    sandbox or an HTTP service would be; `finished` is False when the completion hit its
    token budget."""
    await asyncio.sleep(0)  # a real checker awaits I/O here
    return float(finished and len(completion.split()) == 1)
