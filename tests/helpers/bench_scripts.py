"""Running a benchmark script as its users do, for the benchmarks' smoke tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(args: list[str], timeout_s: float = 300, columns: int = 160) -> subprocess.CompletedProcess:
    """`python ARGS` from the repository root; asserts it exited 0 (with its output tails)."""
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": str(columns)},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc
