"""Roles at different network addresses: buffer shard, learner and rollout services each in a
network namespace of its own (tests/helpers/netns.py: veth pairs on a bridge, private addresses
that exist only inside the namespaces), started with the per-role commands and the `SLUICE__*`
addresses a multi-node deployment passes (deploy/slurm/sluice.sbatch). Every byte between
roles crosses a real interface: experience over ZeroMQ/TCP, weights over gloo and the control
plane over TCP, as between machines. The shard's segment files are on a tmpfs only it sees, so
no client can take the same-host shortcut (docs/architecture.md, "Per-role launch")."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import netns
from helpers.runs import ROOT
from helpers.wait import running, wait_until

from sluice.metrics import read_jsonl
from sluice.testing.netns import Lab, exists

ROLLOUTS = 2
STEPS = 30
SHARD_PORT, CONTROL_PORT, STORE_PORT = 5555, 5600, 29500  # (each namespace has its own ports)
SMALL = [f"learner.total_steps={STEPS}", "rollout.engine=hf", f"rollout.services={ROLLOUTS}"]


def role_env(lab: Lab, run_dir: Path, shard_log: Path) -> dict[str, str]:
    """The addresses every role reads (as deploy/slurm/sluice.sbatch passes them): the shard
    at the buffer host's address, control server and rendezvous store at the learner's."""
    shard = f"tcp://{lab['buffer'].addr}:{SHARD_PORT}"
    learner = lab["learner"].addr
    return {
        "SLUICE__RUN__DIR": str(run_dir),
        "SLUICE__BUFFER__ENDPOINTS": f'["{shard}"]',
        "SLUICE__BUFFER__LOG_DIR": str(shard_log),
        "SLUICE__CONTROL__HOST": learner,
        "SLUICE__CONTROL__PORT": str(CONTROL_PORT),
        "SLUICE__WEIGHT_SYNC__MASTER_ADDR": learner,
        "SLUICE__WEIGHT_SYNC__MASTER_PORT": str(STORE_PORT),
    }


def start_roles(lab: Lab, tmp_path: Path, reaper: list[subprocess.Popen]) -> dict[str, subprocess.Popen]:
    """Shard, learner and rollout services, each in its namespace, logging to run/logs/."""
    run_dir, shard_log = tmp_path / "run", tmp_path / "shard-log"
    (run_dir / "logs").mkdir(parents=True)
    shard_log.mkdir()
    env = role_env(lab, run_dir, shard_log)
    config = str(ROOT / "configs" / "quickstart.yaml")
    commands = {"buffer": ["buffer", "--shard", "0"], "learner": ["learner"]}
    commands |= {f"rollout-{i}": ["rollout", "--index", str(i)] for i in range(ROLLOUTS)}
    roles = {}
    for name, args in commands.items():
        with (run_dir / "logs" / f"{name}.log").open("ab") as log:
            roles[name] = netns.start_in(
                lab[name],
                ["-m", "sluice.cli", args[0], config, *SMALL, *args[1:]],
                reaper,
                stdout=log,
                private_dirs=[shard_log] if name == "buffer" else (),
                **env,
            )
    return roles


def log_tail(tmp_path: Path, name: str) -> str:
    path = tmp_path / "run" / "logs" / f"{name}.log"
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


def none_failed(roles: dict[str, subprocess.Popen], tmp_path: Path) -> Callable[[], None]:
    """A `check` for `wait_until`: fails at once, with the role's log tail, when a role exits
    with an error or the shard exits at all (rollouts end with 0 before the learner does)."""
    shard = running({"buffer": roles["buffer"]}, lambda name: log_tail(tmp_path, name))

    def check() -> None:
        shard()
        for name, proc in roles.items():
            if proc.poll() not in (None, 0):
                raise AssertionError(f"{name} exited with {proc.returncode}\n{log_tail(tmp_path, name)}")

    return check


def rollout_versions(run_dir: Path) -> dict[str, tuple[int, int]]:
    """The oldest and newest weight versions each rollout service generated with (its metrics):
    a service that joined late starts from the weights published then."""
    out = {}
    for path in sorted((run_dir / "metrics").glob("rollout-*.jsonl")):
        versions = [int(r["version"]) for r in read_jsonl(path)] or [-1]
        out[path.name.split(".")[0]] = (min(versions), max(versions))
    return out


@pytest.mark.slow
def test_quickstart_trains_with_every_role_at_its_own_address(tmp_path, process_reaper):
    """The quickstart (30 steps) trains with shard, learner and rollouts in four namespaces; every
    role exits 0; weights and experience crossed the interfaces; the namespaces are gone."""
    labels = ["buffer", "learner", *(f"rollout-{i}" for i in range(ROLLOUTS))]
    with netns.lab(labels) as lab:
        roles = start_roles(lab, tmp_path, process_reaper)
        run_dir = tmp_path / "run"
        learner = roles["learner"]
        wait_until(
            lambda: learner.poll() is not None,
            240,
            "the learner to finish",
            interval_s=0.5,
            check=none_failed(roles, tmp_path),
        )
        assert learner.returncode == 0, log_tail(tmp_path, "learner")
        steps = read_jsonl(run_dir / "metrics" / "learner.jsonl")
        assert len(steps) == STEPS and steps[-1]["version"] == STEPS
        for i in range(ROLLOUTS):  # they end by themselves when the learner announces its end
            assert roles[f"rollout-{i}"].wait(timeout=120) == 0, log_tail(tmp_path, f"rollout-{i}")
        check_weights_crossed_the_bridge(lab, run_dir)
        check_experience_crossed_the_bridge(lab, steps)
        roles["buffer"].send_signal(signal.SIGTERM)
        assert roles["buffer"].wait(timeout=60) == 0, log_tail(tmp_path, "buffer")
        names = [h.netns for h in lab.hosts.values()] + [lab.bridge_ns]
    assert not any(exists(n) for n in names)


def model_bytes(run_dir: Path) -> int:
    """Bytes of the model's weights (its safetensors files, headers included)."""
    return sum(p.stat().st_size for p in (run_dir / "model").glob("*.safetensors"))


def check_weights_crossed_the_bridge(lab: Lab, run_dir: Path) -> None:
    """Each rollout service generated with published weights (versions > 0), which reach it only
    through its interface: the learner's namespace shares no other path with it. Every version
    goes to every member in full from when it joined (measured: the learner's interface sends
    ~versions x members x model bytes, each rollout's receives ~versions held x model bytes; one
    that started late, while the learner ran, joins at the version published then: 17 of 30 in
    one CI run); the bounds leave room for a member that missed versions and pulled the newest
    instead."""
    versions = rollout_versions(run_dir)
    assert sorted(versions) == [f"rollout-{i}" for i in range(ROLLOUTS)], versions
    assert all(newest > 0 for _, newest in versions.values()), versions
    params = model_bytes(run_dir)
    sent = lab["learner"].counters().tx_bytes
    assert sent > STEPS * params, (sent, params)
    for i in range(ROLLOUTS):
        first, newest = versions[f"rollout-{i}"]
        received = lab[f"rollout-{i}"].counters().rx_bytes
        assert received > (newest - first + 1) * params / 2, (i, received, params, first, newest)


def check_experience_crossed_the_bridge(lab: Lab, steps: list[dict]) -> None:
    """Every sample the learner trained on was PUT and leased over ZeroMQ frames: the shard
    offered its segment files (same_host 1), but no producer wrote into them and no consumer
    was served views of them (its token file is on a tmpfs only the shard sees)."""
    endpoint = f"tcp://{lab['buffer'].addr}:{SHARD_PORT}"
    (stats,) = netns.shard_stats(lab["learner"], [endpoint])
    trained = sum(int(s.get("samples", 0)) for s in steps)
    assert stats["same_host"] == 1
    assert stats["region_puts"] == stats["region_bytes"] == stats["refs_served"] == 0, stats
    assert stats["put"] >= stats["acked"] >= trained > 0, (stats, trained)


def test_a_lab_is_gone_after_a_failure_with_processes_inside(process_reaper):
    """Leaving the lab on an error kills what runs in its namespaces and deletes them."""
    with pytest.raises(RuntimeError, match="the test failed"):
        with netns.lab(["a", "b"]) as lab:
            names = [h.netns for h in lab.hosts.values()] + [lab.bridge_ns]
            proc = netns.start_in(lab["a"], ["-c", "import time; time.sleep(600)"], process_reaper)
            wait_until(lambda: proc.pid in lab["a"].pids(), 30, "the process in namespace a")
            raise RuntimeError("the test failed")
    assert proc.wait(timeout=10) is not None
    assert not any(exists(n) for n in names)
