"""A buffer shard, the stand-in learner (`python -m sluice.testing.drain`: control plane and
consumer, no model) and sim rollout services, each a real process started as a deployment
would start it, on one run config; every one is killed at exit. Shared by the benchmarks that
measure the rollout side without a model (rollout_throughput.py's sim part,
dynamic_sampling.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
from common import write_config

from sluice.metrics import read_jsonl
from sluice.net import free_port

ROOT = Path(__file__).resolve().parents[1]


def sim_tree(sim: dict, rollout: dict, **sections: dict) -> dict[str, Any]:
    """The run config of a sim cluster: the copy task, one shard, sim services with `sim` and
    `rollout` settings, admission on with a loose bound (the learner side never throttles)
    unless `sections` (merged per top-level key: learner, task, workflow, ...) say otherwise."""
    tree: dict[str, Any] = {
        "model": {"init": {"vocab": "digits", "max_position_embeddings": 64}},
        "task": {"name": "copy", "params": {"length": 3}},
        "buffer": {"endpoints": [f"tcp://127.0.0.1:{free_port()}"], "capacity": 200000},
        "control": {"port": free_port(), "heartbeat_s": 2.0},
        "rollout": {"engine": "sim", "services": 64, "sim": sim, **rollout},
        "learner": {"batch_size": 8, "max_staleness": 1000},
    }
    for key, value in sections.items():
        tree[key] = {**tree.get(key, {}), **value}
    return tree


class Cluster:
    """The processes of one sim cluster in `work` (config, logs, the drain's timeline)."""

    def __init__(self, work: Path, tree: dict[str, Any], drain_step_s: float = 0.0) -> None:
        self.work = work
        self.procs: list[subprocess.Popen] = []
        self.services: list[subprocess.Popen] = []
        self.cfg, self.config_path = write_config(work, {"run": {"dir": str(work / "run")}, **tree})
        self.timeline = work / "drain.jsonl"
        self.drain_step_s = drain_step_s
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

    def _spawn(self, args: list[str], name: str) -> subprocess.Popen:
        log = (self.work / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def start_core(self) -> None:
        self._spawn(["-m", "sluice.cli", "buffer", str(self.config_path), "--shard", "0"], "buffer")
        drain = ["-m", "sluice.testing.drain", str(self.config_path), "--out", str(self.timeline)]
        self._spawn([*drain, "--step-s", str(self.drain_step_s)], "drain")

    def grow_to(self, n: int) -> None:
        while len(self.services) < n:
            i = len(self.services)
            self.services.append(
                self._spawn(
                    ["-m", "sluice.cli", "rollout", str(self.config_path), "--index", str(i)], f"rollout-{i}"
                )
            )

    def check_alive(self) -> None:
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[2:4]} exited with {p.returncode}; see logs in {self.work}")

    def timeline_records(self) -> list[dict]:
        return read_jsonl(self.timeline)

    def services_rss_mb(self) -> float:
        total = 0
        for p in self.services:
            try:
                total += psutil.Process(p.pid).memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total / 2**20

    def close(self) -> None:
        """Stop the processes in the reverse of their start, each before the next: the services,
        then the stand-in learner, then the shard, so that no client waits on a GET to a shard
        already gone (the drain did, up to its timeout). SIGKILL what outlives 20 s in all."""
        deadline = time.monotonic() + 20
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()
