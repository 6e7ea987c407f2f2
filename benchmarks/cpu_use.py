"""Where a run's CPU goes, per training step: the CPU time of each process (and of its main
thread, which is a Sluice learner's training thread) between a step after warm-up and the last
look before the run ended, divided by the steps in between.

On a machine the roles share, this is what tells a role that waits from a machine that is
full: `busy` is the CPU of every watched process over the cores' capacity in the same window
(docs/architecture.md, "Cores and threads"). Read with psutil (per-thread times from
/proc/<pid>/task on Linux), polled by the benchmark's progress watcher, so a role that exits
at the end has already been read.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class Look:
    """One reading: when, at which step, and (process seconds, main-thread seconds) by name."""

    time: float
    step: int
    cpu: dict[str, tuple[float, float]]


def read_cpu(pids: dict[str, int]) -> dict[str, tuple[float, float]]:
    """name -> (CPU seconds of the whole process, of its main thread); gone processes left out."""
    out = {}
    for name, pid in pids.items():
        try:
            proc = psutil.Process(pid)
            with proc.oneshot():
                times = proc.cpu_times()
                main = next((t for t in proc.threads() if t.id == pid), None)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        whole = times.user + times.system
        out[name] = (whole, main.user_time + main.system_time if main else whole)
    return out


class CpuSampler:
    """Polled with the run's step count: the first look once `warmup` steps are done, then the
    latest look, kept while every process seen at the first is still there."""

    def __init__(self, pids: Callable[[], dict[str, int]], warmup: int, cores: int | None = None) -> None:
        self.pids = pids  # name -> pid of what to watch (roles appear as they start)
        self.warmup = warmup
        self.cores = cores or len(os.sched_getaffinity(0))
        self.first: Look | None = None
        self.last: Look | None = None

    def poll(self, step: int) -> None:
        if step < self.warmup:
            return
        look = Look(time.monotonic(), step, read_cpu(self.pids()))
        if self.first is None:
            self.first = look
        elif step > self.first.step and set(look.cpu) >= set(self.first.cpu):
            self.last = look

    def per_step(self) -> dict | None:
        """CPU seconds per step by name (`<name>:main` for the main thread), their total, the
        wall seconds per step over the same window, and `busy`: total / (cores x wall)."""
        first, last = self.first, self.last
        if first is None or last is None:
            return None
        steps = last.step - first.step
        wall = (last.time - first.time) / steps
        cpu = {}
        for name, (whole, main) in first.cpu.items():
            cpu[name] = (last.cpu[name][0] - whole) / steps
            cpu[f"{name}:main"] = (last.cpu[name][1] - main) / steps
        total = sum(v for k, v in cpu.items() if not k.endswith(":main"))
        return {
            "steps": [first.step, last.step],
            "cpu_s": cpu,
            "total_s": total,
            "wall_s": wall,
            "cores": self.cores,
            "busy": total / (self.cores * wall),
        }
