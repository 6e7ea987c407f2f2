"""benchmarks/cpu_use.py: CPU per step of real processes (one spinning, one asleep), the
window it reads, and a process that ends before the last look."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest
from helpers.bench_scripts import ROOT
from helpers.wait import wait_until


@pytest.fixture
def cpu_use(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import cpu_use

    return cpu_use


def spawn(code: str, reaper: list[subprocess.Popen]) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    reaper.append(proc)
    return proc


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def test_cpu_per_step_of_a_busy_and_an_idle_process(cpu_use, process_reaper):
    busy = spawn("while True: pass", process_reaper)
    idle = spawn("import time; time.sleep(600)", process_reaper)
    # past its interpreter's start-up (CPU it would spend inside the window), asleep for good
    asleep = lambda: psutil.Process(idle.pid).status() == psutil.STATUS_SLEEPING  # noqa: E731
    wait_until(asleep, 30, "the idle process asleep")
    sampler = cpu_use.CpuSampler(lambda: {"busy": busy.pid, "idle": idle.pid}, warmup=2, cores=2)
    sampler.poll(1)  # before the warm-up ends: not a look
    assert sampler.first is None and sampler.per_step() is None
    sampler.poll(2)
    start = cpu_seconds(busy.pid)
    wait_until(lambda: cpu_seconds(busy.pid) >= start + 0.4, 30, "the busy process used 0.4 s of CPU")
    sampler.poll(4)
    got = sampler.per_step()
    assert got is not None and got["steps"] == [2, 4]
    cpu = got["cpu_s"]
    assert cpu["busy"] >= 0.2 - 1e-6  # >= 0.4 s over 2 steps
    assert cpu["busy:main"] == pytest.approx(cpu["busy"], abs=0.02)  # one thread: the main one
    assert cpu["idle"] < 0.01
    assert got["total_s"] == pytest.approx(cpu["busy"] + cpu["idle"])
    assert 0 < got["busy"] <= 1.0 and got["cores"] == 2


def test_a_look_missing_a_process_seen_at_the_first_is_not_kept(cpu_use, process_reaper):
    one = spawn("import time; time.sleep(600)", process_reaper)
    two = spawn("import time; time.sleep(600)", process_reaper)
    sampler = cpu_use.CpuSampler(lambda: {"one": one.pid, "two": two.pid}, warmup=0, cores=2)
    sampler.poll(0)
    sampler.poll(3)
    assert sampler.last is not None and sampler.last.step == 3
    two.kill()
    two.wait()
    sampler.poll(5)  # `two` is gone: its CPU can no longer be read, so the window ends at 3
    assert sampler.last.step == 3 and sampler.per_step()["steps"] == [0, 3]
