"""Waiting on a condition, never for a fixed time: a test goes on as soon as what it needs is
true, and fails with a message naming what never came (a sleep is either too long or flaky)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    timeout_s: float,
    what: str | Callable[[], str],
    *,
    interval_s: float = 0.02,
    check: Callable[[], None] | None = None,
) -> T:
    """Poll `predicate` until it returns something true, and return that.

    `check` runs before each poll and may fail the wait early (say, assert that a process the
    test waits on still lives). After `timeout_s` this raises AssertionError naming `what`; a
    callable `what` is evaluated then, to tell the last state seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        if check is not None:
            check()
        got = predicate()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g}s: {what() if callable(what) else what}")
        time.sleep(interval_s)


def running(
    procs: Mapping[str, subprocess.Popen], tail: Callable[[str], str] | None = None
) -> Callable[[], None]:
    """A `check` for `wait_until`: fails at once when one of `procs` (by name; the mapping is
    read at each poll) has exited, with its exit code and `tail(name)`, say its log's end."""

    def check() -> None:
        for name, proc in procs.items():
            if proc.poll() is not None:
                detail = tail(name) if tail is not None else ""
                raise AssertionError(f"{name} exited with {proc.returncode} meanwhile\n{detail}")

    return check
