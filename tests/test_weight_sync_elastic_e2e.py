"""Elastic rollout membership in a real run: a rollout service is killed (SIGKILL) and another
one started while the learner trains; training goes on, the new service pulls the current
weights, joins the broadcast group and produces samples with the learner's newest versions."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from helpers.procs import start
from helpers.runs import HF_ENGINE
from helpers.wait import running, wait_until

from sluice.config.loader import dump_config, load_config
from sluice.launch.local import resolve
from sluice.metrics import read_jsonl
from sluice.modeling import materialize_model_dir
from sluice.net import HeldPorts

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"

pytestmark = pytest.mark.slow


def start_role(run_dir: Path, config: Path, name: str, *args: str, reaper: list) -> subprocess.Popen:
    with (run_dir / "logs" / f"{name}.log").open("ab") as log:
        args = ("-m", "sluice.cli", *args, str(config))
        return start(args, reaper, stdout=log, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


@pytest.fixture
def held_ports():
    """The run's ports, held as `sluice run` holds them until its roles are gone."""
    with HeldPorts() as ports:
        yield ports


def test_rollout_killed_and_another_started_while_training_continues(tmp_path, process_reaper, held_ports):
    run_dir = tmp_path / "run"
    cfg = load_config(
        QUICKSTART,
        [
            f"run.dir={run_dir}",
            HF_ENGINE,
            "learner.total_steps=100000",  # the test stops the learner (SIGTERM: a clean stop)
            "metrics.tensorboard=false",
            "weight_sync.ready_timeout_s=3",
            "weight_sync.liveness_timeout_s=3",
        ],
    )
    cfg = resolve(cfg, held_ports)
    (run_dir / "logs").mkdir(parents=True)
    materialize_model_dir(cfg.model, cfg.run_dir)
    config = run_dir / "config.yaml"
    dump_config(cfg, config)
    roles = {
        "buffer-0": ("buffer", "--shard", "0"),
        "learner": ("learner",),
        "rollout-0": ("rollout", "--index", "0"),
        "rollout-1": ("rollout", "--index", "1"),
    }
    procs = {
        name: start_role(run_dir, config, name, *args, reaper=process_reaper) for name, args in roles.items()
    }
    steps = lambda: read_jsonl(run_dir / "metrics" / "learner.jsonl")  # noqa: E731
    alive = running(procs)  # (the roles the test has not stopped itself)
    wait_until(lambda: len(steps()) >= 10, 180, "10 learner steps", interval_s=0.25, check=alive)

    os.killpg(procs.pop("rollout-1").pid, signal.SIGKILL)  # a crash, no LEAVE
    killed_at = len(steps())
    procs["rollout-2"] = start_role(
        run_dir, config, "rollout-2", "rollout", "--index", "2", reaper=process_reaper
    )

    def follows_over_the_group() -> bool:
        """The newcomer pulled a version over ZeroMQ, joined the group, and generated with a
        newer version, which only the group's broadcast can have brought it."""
        pulled = re.findall(r"pulled v(\d+)", (run_dir / "logs" / "rollout-2.log").read_text())
        batches = read_jsonl(run_dir / "metrics" / "rollout-2.jsonl")
        return bool(pulled) and any(b["version"] > int(pulled[0]) for b in batches)

    wait_until(
        follows_over_the_group, 240, "the new service following the learner", interval_s=0.25, check=alive
    )
    # Training goes on past the membership change (the newcomer may follow within a step or two).
    more = lambda: len(steps()) > killed_at + 5  # noqa: E731
    wait_until(more, 120, "5 more learner steps", interval_s=0.25, check=alive)
    learner = procs.pop("learner")
    learner.send_signal(signal.SIGTERM)
    assert learner.wait(timeout=120) == 0, (run_dir / "logs" / "learner.log").read_text()[-3000:]

    versions = [s["version"] for s in steps()]
    assert versions == list(range(1, len(versions) + 1)) and len(versions) > killed_at + 5  # never stopped
    assert steps()[-1]["total_violations"] == 0
    for name in ("rollout-0", "rollout-2"):  # both leave cleanly when the learner is done
        assert procs[name].wait(timeout=60) == 0, (run_dir / "logs" / f"{name}.log").read_text()[-3000:]
    assert "is rank" in (run_dir / "logs" / "rollout-2.log").read_text()
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert "leaves out ['rollout-1']" in learner_log  # the crashed service was dropped from the group
