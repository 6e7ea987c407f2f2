"""Sim rollout services against real shards and the stand-in learner (sluice/testing/drain.py):
the config they share, the per-role command, and the drain in a thread of the test."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

from helpers.procs import start
from helpers.wait import running, wait_until
from sluice.config.loader import config_from_dict, dump_config
from sluice.net import free_port
from sluice.testing.drain import Drain


def sim_config(tmp_path: Path, shard, **sections):
    tree = {
        "run": {"dir": str(tmp_path / "run")},
        "model": {"init": {"vocab": "digits"}},
        "task": {"name": "copy", "params": {"length": 3}},
        "buffer": {"endpoints": [shard.endpoint]},
        "control": {"port": free_port(), "heartbeat_s": 0.5},
        "rollout": {
            "engine": "sim",
            "services": 2,
            "group_size": 4,
            "prompts_per_batch": 1,
            "max_new_tokens": 4,
            "sim": {"decode_step_s": 0.01, "decode_s_per_seq": 0.0, "eos_prob": 0.2},
        },
        "learner": {"batch_size": 8, "max_staleness": 1},
    }
    for key, value in sections.items():
        tree[key] = {**tree.get(key, {}), **value}
    cfg = config_from_dict(tree)
    path = tmp_path / "config.yaml"
    (tmp_path / "run").mkdir(parents=True, exist_ok=True)
    dump_config(cfg, path)
    return cfg, path


def start_service(path: Path, index: int, reaper: list) -> subprocess.Popen:
    """The per-role command, as a cluster or compose would run it."""
    args = ["-m", "sluice.cli", "rollout", str(path), "--index", str(index)]
    return start(args, reaper, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


class DrainThread:
    def __init__(self, cfg, **kwargs) -> None:
        self.drain = Drain(cfg, **kwargs)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.drain.run, args=(self.stop,), daemon=True)
        self.thread.start()

    def wait_for(self, predicate, timeout_s: float, procs=()) -> None:
        """Until `predicate(what the drain saw)`, while every one of `procs` lives."""
        services = {f"service pid {p.pid}": p for p in procs}
        check = running(services, lambda name: services[name].stderr.read().decode()[-3000:])
        snapshot = self.drain.snapshot
        wait_until(lambda: predicate(snapshot()), timeout_s, lambda: f"drain saw {snapshot()}", check=check)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        self.drain.close()
