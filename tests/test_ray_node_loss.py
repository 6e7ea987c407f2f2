"""`sluice ray` on a Ray cluster of three nodes, each a network namespace with an address of its
own (tests/helpers/netns.py): the node holding the learner and the shard dies (every process in
it stopped, the learner killed -9 so that its death is reported first, then the rest, its
raylet too), Ray moves their bundles to a node that joined later, and the run goes on with both
at their new addresses and one learner-group restart.

What it caught, each before its fix: with the old node's address still in the config nothing
could reach the moved roles (the namespaces share no other path), so the rollout services asked
a control plane that was not there and no step followed the resume (the re-addressing:
sluice/launch/ray_addresses.py); handled one by one, learner first, the driver placed the
learner's new actor on the dying node and failed when it died there, and once such actors were
started again the group restarted twice (the node-loss grouping: ray_node_loss.py).
docs/architecture.md, "Ray launcher"."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from helpers import netns, procs
from helpers.run_state import launcher_events, role_pids
from helpers.runs import HF_ENGINE
from helpers.wait import running, wait_until

from sluice.metrics import read_jsonl
from sluice.testing.netns import IFNAME, SUBNET, Host

pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")
GCS_PORT = 6390
STEPS, KILL_AFTER = 80, 12  # checkpoints every 5 steps: the learner resumes from 10 or later
RAY_ENV = {
    "RAY_AUTH_MODE": "disabled",  # (token auth is on by default for a head off localhost)
    # a dead node is declared dead in ~2 s, not ~30 s
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "4",
    "GLOO_SOCKET_IFNAME": IFNAME,  # weight sync's gloo, on each namespace's interface
    "OMP_NUM_THREADS": "1",
}
MOVABLE = '--resources={"movable": 2}'  # room for the learner and the shard


def ray_start(host: Host, *args: str) -> None:
    """`ray start` in `host`'s namespace (its daemons stay there; the lab kills them)."""
    proc = subprocess.run(
        [*host.wrap(), RAY, "start", f"--node-ip-address={host.addr}", "--disable-usage-stats", *args],
        env=procs.child_env(**RAY_ENV),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


@pytest.fixture
def forget_cluster() -> Iterator[None]:
    """`ray start --head` leaves its address where `ray.init()` without one looks for a running
    cluster (<tmp>/ray/ray_current_cluster): removed afterwards, if it is still this test's."""
    yield
    found = Path(os.environ.get("TMPDIR", "/tmp")) / "ray" / "ray_current_cluster"
    if found.exists() and found.read_text().startswith(f"{SUBNET}."):
        found.unlink()


def test_a_learner_and_shard_whose_node_dies_go_on_at_their_new_addresses(
    tmp_path, process_reaper, forget_cluster
):
    with netns.lab(["head", "a", "b"]) as lab:
        head, a, b = lab["head"], lab["a"], lab["b"]
        # the rollout services fit only on the head, the learner and the shard only on a or b; b
        # joins once the roles are placed (before the first step), so both are on a
        ray_start(head, "--head", f"--port={GCS_PORT}", "--num-cpus=2", '--resources={"head_slot": 2}',
                  "--include-dashboard=false")  # fmt: skip
        ray_start(a, f"--address={head.addr}:{GCS_PORT}", "--num-cpus=2", MOVABLE)
        run_dir, log = tmp_path / "run", tmp_path / "driver.log"
        driver = start_run(head, run_dir, log, tmp_path / "shards", process_reaper)
        alive = running({"sluice ray": driver}, lambda _: log.read_text()[-3000:])

        def steps() -> list[dict]:
            return read_jsonl(run_dir / "metrics" / "learner.jsonl")

        wait_until(lambda: len(events(run_dir, "placed")) == 4, 300, "placement", check=alive)
        placed = events(run_dir, "placed")
        assert placed["learner"]["ip"] == placed["buffer-0"]["ip"] == a.addr, placed
        ray_start(b, f"--address={head.addr}:{GCS_PORT}", "--num-cpus=2", MOVABLE)
        wait_until(
            lambda: len(steps()) >= KILL_AFTER, 300, f"{KILL_AFTER} steps", interval_s=0.2, check=alive
        )
        assert len(steps()) < STEPS - 10  # (node b started in time)
        # node a stops, its learner's death is reported first, then the node dies: handled one
        # by one, the learner group would restart at the shard's old address, then again
        for pid in a.pids():
            os.kill(pid, signal.SIGSTOP)
        os.kill(role_pids(run_dir)["learner"], signal.SIGKILL)
        wait_until(lambda: "whether they are still there" in log.read_text(), 60, "the driver's check")
        for pid in a.pids():
            os.kill(pid, signal.SIGKILL)
        assert driver.wait(timeout=400) == 0, log.read_text()[-4000:]
    moved = events(run_dir, "restarted")
    for role in ("learner", "buffer-0"):
        assert moved[role]["ip"] == b.addr and moved[role]["node_id"] != placed[role]["node_id"], moved
        assert moved[role]["ports_held_by"] != placed[role]["ports_held_by"]  # a new keeper, on b
    # one group restart for both: the shard's move, handled first, restarts the group
    learner_restarts = [e for e in launcher_events(run_dir, "restarted") if e["role"] == "learner"]
    checks = [line for line in log.read_text().splitlines() if "node check" in line or "died: asking" in line]
    assert len(learner_restarts) == 1, (learner_restarts, checks)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["control"]["host"] == config["weight_sync"]["master_addr"] == b.addr
    assert config["buffer"]["endpoints"][0].startswith(f"tcp://{b.addr}:")
    assert [s["version"] for s in steps()] == list(range(1, STEPS + 1))
    # the rollout services, restarted with the group, took weights from the learner's new address
    last = max(moved[r]["time"] for r in ("learner", "buffer-0"))
    after = [r for r in read_jsonl(run_dir / "metrics" / "rollout-0.jsonl") if r["time"] > last]
    assert after and max(r["version"] for r in after) > KILL_AFTER


def start_run(head: Host, run_dir: Path, log: Path, shards: Path, reaper: list) -> subprocess.Popen:
    """The quickstart (hf engine) under `sluice ray` from the head's namespace, its shard's log
    in `shards` (every node's: one file system here)."""
    args = ["-m", "sluice.cli", "ray", str(ROOT / "configs" / "quickstart.yaml"), f"run.dir={run_dir}",
            HF_ENGINE, f"learner.total_steps={STEPS}", "learner.checkpoint_every=5",
            f"buffer.log_dir={shards}", f"ray.address={head.addr}:{GCS_PORT}",
            "ray.learner.resources={movable: 1}", "ray.buffer.resources={movable: 1}",
            "ray.rollout.resources={head_slot: 1}", "--no-progress"]  # fmt: skip
    with log.open("wb") as out:
        return netns.start_in(head, args, reaper, stdout=out, **RAY_ENV)


def events(run_dir: Path, kind: str) -> dict[str, dict]:
    """The launcher's last `kind` event of each role."""
    return {e["role"]: e for e in launcher_events(run_dir, kind)}
