"""Child processes of a test (`python -m sluice.cli <role> ...`, a helper script): started from
the repository root, in a session of their own, so that the `process_reaper` fixture
(tests/conftest.py) kills each one's whole process group at teardown, also when the test fails."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[2]


def child_env(env: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """`env` (default: this process's environment) with the repository and tests/ on
    PYTHONPATH, so a child imports `sluice` and `helpers` as the tests do; plus `extra`."""
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    return {**(os.environ if env is None else env), "PYTHONPATH": path, **extra}


def start(
    args: Sequence[str],
    reaper: list[subprocess.Popen],
    *,
    stdout: int | IO[Any] | None = subprocess.PIPE,
    stderr: int | IO[Any] | None = subprocess.STDOUT,
    prefix: Sequence[str] = (),
    **extra_env: str,
) -> subprocess.Popen:
    """`python ARGS` (say `["-m", "sluice.cli", "buffer", config]`) with `child_env(**extra_env)`,
    registered with `reaper` (the `process_reaper` fixture). `prefix` runs it through another
    command that execs it (say `ip netns exec NS`, helpers/netns.py): the pid stays the same."""
    proc = subprocess.Popen(
        [*prefix, sys.executable, *args],
        cwd=ROOT,
        env=child_env(**extra_env),
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
    )
    reaper.append(proc)
    return proc
