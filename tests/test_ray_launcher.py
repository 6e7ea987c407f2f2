"""`sluice ray` on a local Ray instance (started and shut down by the launcher): every role is
its own Ray-placed actor process, addresses travel through Ray. (Killed roles replaced under Ray:
tests/chaos/test_chaos.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from helpers.plugin_example import TASK_BY_FILE, rewards_by_file
from helpers.run_state import launcher_events as events
from helpers.runs import HF_ENGINE

from sluice.launch.ray_logs import ROLE_ENDED
from sluice.metrics import read_jsonl

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
ROLES = {"buffer-0", "learner", "rollout-0", "rollout-1"}


def start_ray_run(run_dir: Path, log: Path, *overrides: str) -> subprocess.Popen:
    with log.open("wb") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sluice.cli",
                "ray",
                str(QUICKSTART),
                f"run.dir={run_dir}",
                "ray.local_num_cpus=4",
                HF_ENGINE,
                *overrides,
                "--no-progress",
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "RAY_DEDUP_LOGS": "0"},
        )


def descendants(pid: int) -> set[int]:
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def alive(pids: set[int]) -> set[int]:
    return {p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE}


def test_ray_run_trains_with_every_role_a_separate_ray_process(tmp_path, process_reaper):
    """Also a user's task and rewards given by file (examples/sluice-plugin-example's, outside
    any package): the Ray actors resolve them as `sluice run`'s processes do."""
    run_dir, log = tmp_path / "run", tmp_path / "driver.log"
    proc = start_ray_run(run_dir, log, "learner.total_steps=8", TASK_BY_FILE, rewards_by_file())
    process_reaper.append(proc)
    seen: set[int] = set()
    deadline = time.monotonic() + 400
    while proc.poll() is None:
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        seen |= descendants(proc.pid)  # Ray's own processes and the role actors
        time.sleep(0.5)  # sampling the process tree while the run lasts (not a wait)
    output = log.read_text()
    assert proc.returncode == 0, output[-4000:]

    steps = read_jsonl(run_dir / "metrics" / "learner.jsonl")
    assert [s["version"] for s in steps] == list(range(1, 9))
    assert (run_dir / "checkpoints" / "step_000008" / "model.safetensors").is_file()

    # one placement-group bundle and one process per role, none of them the driver
    placed = {e["role"]: e for e in events(run_dir, "placed")}
    assert set(placed) == ROLES
    assert sorted(e["bundle"] for e in placed.values()) == [0, 1, 2, 3]
    pids = {e["pid"] for e in placed.values()}
    assert len(pids) == 4 and proc.pid not in pids
    # each role ran inside its actor's process (the role records its own pid)
    for role in ROLES:
        assert json.loads((run_dir / "endpoints" / f"{role}.json").read_text())["pid"] == placed[role]["pid"]
    # the addresses were resolved through Ray: the node IP the actors reported
    import yaml

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["buffer"]["endpoints"][0].startswith(f"tcp://{placed['buffer-0']['ip']}:")
    assert cfg["control"]["host"] == cfg["weight_sync"]["master_addr"] == placed["learner"]["ip"]
    # logs streamed to the driver with the role as prefix, up to each role's last line (the
    # driver waits for it before it disconnects), and kept per role in the run dir
    assert "(sluice-learner pid=" in output and "(sluice-rollout-1 pid=" in output, output
    for role in ROLES:  # (a rollout that joins as the learner ends may end on a failed weight feed)
        assert f"{ROLE_ENDED} {role} (" in output, output
    assert all((run_dir / "logs" / f"{role}.log").stat().st_size > 0 for role in ROLES)
    assert (run_dir / "plots" / "reward.png").is_file()
    assert "mean/reward_stops_after_one" in read_jsonl(run_dir / "metrics" / "rollout-0.jsonl")[-1]
    # Ray (its processes are the driver's descendants, the role actors among them) is gone
    assert pids <= seen
    assert not alive(seen)


def ray_run(
    run_dir: Path, config: Path, *overrides: str, timeout: float = 500
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "sluice.cli",
            "ray",
            str(config),
            f"run.dir={run_dir}",
            *overrides,
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        env={**os.environ, "RAY_DEDUP_LOGS": "0"},
    )


CARTPOLE = ROOT / "configs" / "cartpole.yaml"


@pytest.fixture(scope="module")
def two_node_cluster() -> Iterator[str]:
    """Two Ray nodes on this machine (ray.cluster_utils.Cluster: separate raylets, separate
    resources, 3 CPUs each), started once for the module's cases; yields its address."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3})
    try:
        cluster.add_node(num_cpus=3)
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        cluster.shutdown()


@pytest.mark.parametrize(
    "config, overrides, learners",
    [
        (CARTPOLE, ["learner.target_return=null", "learner.total_steps=10"], {"learner": 10}),
        (CARTPOLE, ["learner.target_return=null", "learner.total_steps=10", "learner.policies=[a, b]"],
         {"learner": 10, "learner-b": 10}),
        (QUICKSTART, [HF_ENGINE, "learner.ranks=2", "learner.total_steps=6"], {"learner": 6}),
    ],
    ids=["cartpole", "two-policies", "learner-group-of-2"],
)  # fmt: skip
def test_every_config_trains_spread_over_a_two_node_cluster(
    tmp_path, two_node_cluster, config, overrides, learners
):
    """Env rollouts, several policies, and the quickstart with a learner group of K ranks, each on
    two Ray nodes on this machine with ray.strategy=SPREAD: the same role plan as `sluice run`
    (sluice/launch/plan.py), each role its own Ray actor, roles on both nodes. The cases run one
    after another on one cluster (started once: ~8 s each), so each also shows the run before it
    gave back what it held: a leaked placement group would leave this one's plan short of CPUs."""
    from sluice.config import load_config
    from sluice.launch.plan import plan_roles

    run_dir = tmp_path / "run"
    proc = ray_run(run_dir, config, *overrides, f"ray.address={two_node_cluster}", "ray.strategy=SPREAD")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    for name, steps in learners.items():
        assert len(read_jsonl(run_dir / "metrics" / f"{name}.jsonl")) == steps
    placed = {e["role"]: e["node_id"] for e in events(run_dir, "placed")}
    print(f"placement: {placed}")
    assert sorted(placed) == sorted(s.name for s in plan_roles(load_config(config, overrides)))
    assert len(set(placed.values())) == 2, placed  # both nodes hold roles
    assert {e["role"] for e in events(run_dir, "exit") if e["rc"] == 0} >= set(learners)


def test_a_cluster_too_small_for_the_plan_is_refused_in_seconds(tmp_path):
    started = time.monotonic()
    proc = ray_run(tmp_path / "run", QUICKSTART, HF_ENGINE, "ray.local_num_cpus=1", timeout=120)
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    said = " ".join(proc.stderr.split())  # the console wraps long lines
    assert "CPU: 4 needed, 1 in the cluster" in said and "ray.buffer/learner/rollout.num_cpus" in said
    assert time.monotonic() - started < 60
