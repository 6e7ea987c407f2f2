"""`sluice run` from the end-to-end tests: to completion, or in the background to watch."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from helpers import wait
from sluice.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
# The quickstart's `rollout.engine: auto` picks vLLM where it is installed; test runs use the HF
# engine (seconds to start, not tens) unless a test names an engine itself.
HF_ENGINE = "rollout.engine=hf"


def with_hf_engine(config: str, overrides: tuple[str, ...]) -> tuple[str, ...]:
    if config != "quickstart.yaml" or any(o.startswith("rollout.engine=") for o in overrides):
        return overrides
    return (HF_ENGINE, *overrides)


def run_command(config: str, run_dir: Path, overrides: tuple[str, ...]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "sluice.cli",
        "run",
        str(ROOT / "configs" / config),
        f"run.dir={run_dir}",
        *with_hf_engine(config, overrides),
        "--no-progress",
    ]


def sluice_run(
    run_dir: Path, *overrides: str, config: str = "quickstart.yaml", timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run to the end; stdout and stderr captured as text."""
    return subprocess.run(
        run_command(config, run_dir, overrides), capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def start_run(
    run_dir: Path, *overrides: str, config: str = "quickstart.yaml", env: Mapping[str, str] | None = None
) -> subprocess.Popen:
    """Start in its own session (register it with the `process_reaper` fixture); output piped."""
    return subprocess.Popen(
        run_command(config, run_dir, overrides),
        cwd=ROOT,
        env=None if env is None else dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def learner_steps(run_dir: Path) -> int:
    return len(read_jsonl(run_dir / "metrics" / "learner.jsonl"))


def wait_until(
    predicate: Callable[[], bool], proc: subprocess.Popen, what: str, timeout: float = 180
) -> None:
    """Poll `predicate` while the run lives; fail with the run's output if it ends first."""

    def output(_: str) -> str:
        return proc.stdout.read().decode()[-3000:] if proc.stdout else ""

    wait.wait_until(predicate, timeout, what, interval_s=0.5, check=wait.running({"the run": proc}, output))


def wait_for_steps(run_dir: Path, n: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    wait_until(lambda: learner_steps(run_dir) >= n, proc, f"{n} learner steps", timeout)
