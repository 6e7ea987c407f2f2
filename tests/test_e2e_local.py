"""End to end: `sluice run` with real processes and real ZeroMQ on this machine."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import psutil
import pytest
from helpers import wait
from helpers.runs import learner_steps, sluice_run, start_run, wait_until

from sluice.metrics import read_jsonl

pytestmark = pytest.mark.slow


def port_is_free(port: int) -> bool:
    """Nothing listens on the port and a server could bind it again now (SO_REUSEADDR, as
    ZeroMQ and TCPStore bind; connections of the ended run may linger in TIME_WAIT)."""
    listening = {c.laddr.port for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    if port in listening:
        return False
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def run_ports(run_dir: Path) -> list[int]:
    import yaml

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    ports = [int(ep.rsplit(":", 1)[1]) for ep in cfg["buffer"]["endpoints"]]
    ports.append(int(cfg["weight_sync"]["master_port"]))
    for rec in (run_dir / "endpoints").glob("*.json"):
        ports.append(json.loads(rec.read_text())["metrics_port"])
    return ports


def role_pids(run_dir: Path) -> list[int]:
    return [json.loads(p.read_text())["pid"] for p in (run_dir / "endpoints").glob("*.json")]


def test_quickstart_learns_and_cleans_up(tmp_path):
    run_dir = tmp_path / "run"
    proc = sluice_run(run_dir, "learner.total_steps=150")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = read_jsonl(run_dir / "metrics" / "learner.jsonl")
    assert [s["version"] for s in steps] == list(range(1, 151))
    first = sum(s["reward_mean"] for s in steps[:15]) / 15
    last = sum(s["reward_mean"] for s in steps[-15:]) / 15
    assert last > first + 0.05, (first, last)  # the policy improved
    # the staleness bound held on every step, and the safety net never fired
    assert all(s["staleness_max"] <= 2 for s in steps)
    assert steps[-1]["total_violations"] == 0
    # final checkpoint, loadable as a Hugging Face model
    from transformers import AutoModelForCausalLM

    ckpt = run_dir / "checkpoints" / "step_000150"
    assert (ckpt / "model.safetensors").is_file()
    AutoModelForCausalLM.from_pretrained(ckpt)
    # every role got and left its endpoints; no process or port is left behind
    assert {"learner", "buffer-0", "rollout-0", "rollout-1"} <= {
        p.stem for p in (run_dir / "endpoints").glob("*.json")
    }
    assert not [pid for pid in role_pids(run_dir) if psutil.pid_exists(pid)]
    assert all(port_is_free(p) for p in run_ports(run_dir))


def test_synchronous_bound_consumes_only_current_version(tmp_path):
    run_dir = tmp_path / "run"
    proc = sluice_run(run_dir, "learner.total_steps=12", "learner.max_staleness=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = read_jsonl(run_dir / "metrics" / "learner.jsonl")
    assert len(steps) == 12
    assert all(s["staleness_max"] == 0 for s in steps)
    assert steps[-1]["total_violations"] == 0


def test_killed_rollout_is_restarted_then_ctrl_c_stops_every_role_and_frees_ports(tmp_path, process_reaper):
    run_dir = tmp_path / "run"
    proc = start_run(run_dir, "learner.total_steps=100000")
    process_reaper.append(proc)
    record = run_dir / "endpoints" / "rollout-0.json"
    # one service alone can feed the first steps while the other is still starting (a loaded machine)
    wait_until(lambda: learner_steps(run_dir) >= 5 and record.exists(), proc, "5 learner steps, rollout-0 up")

    # kill -9 a rollout service: the launcher starts it again and training goes on
    killed = json.loads(record.read_text())["pid"]
    os.kill(killed, signal.SIGKILL)
    events = run_dir / "metrics" / "launcher.jsonl"
    wait_until(lambda: any(e.get("event") == "restarted" for e in read_jsonl(events)), proc, "a restart")
    restarted = next(e for e in read_jsonl(events) if e.get("event") == "restarted")
    assert (
        restarted["role"] == "rollout-0" and restarted["rc"] == -signal.SIGKILL and restarted["restarts"] == 1
    )
    wait_until(
        lambda: json.loads(record.read_text())["pid"] == restarted["pid"], proc, "the new rollout-0 serving"
    )
    steps = learner_steps(run_dir)
    wait_until(lambda: learner_steps(run_dir) >= steps + 5, proc, "5 more learner steps")

    pids = role_pids(run_dir)
    assert len(pids) == 4 and killed not in pids
    os.kill(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal sends to the launcher
    proc.wait(timeout=60)
    assert proc.returncode == 130

    def survivors() -> list[int]:
        return [
            p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]

    wait.wait_until(lambda: not survivors(), 5, lambda: f"every role gone (alive: {survivors()})")
    assert all(port_is_free(p) for p in run_ports(run_dir))


def test_bad_config_gives_one_line_error_naming_the_key(tmp_path):
    proc = sluice_run(tmp_path / "run", "learner.loss.type=nope", timeout=60)
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert "learner.loss.type" in line and "grpo" in line
    proc = sluice_run(tmp_path / "run", "learner.lerning_rate=1", timeout=60)
    assert proc.returncode == 2 and "learner.lerning_rate: unknown key" in proc.stderr


def test_a_learner_paused_20s_costs_no_rollout_restart(tmp_path, process_reaper):
    """SIGSTOP the learner for longer than a control-plane time-out (10 s): rollout services
    keep asking (same seq, answered once) instead of dying, and training goes on after SIGCONT."""
    run_dir = tmp_path / "run"
    proc = start_run(run_dir, "learner.total_steps=100000")
    process_reaper.append(proc)
    records = [run_dir / "endpoints" / name for name in ("learner.json", "rollout-0.json", "rollout-1.json")]
    wait_until(lambda: learner_steps(run_dir) >= 5 and all(r.exists() for r in records), proc, "5 steps")
    pids = {r.stem: json.loads(r.read_text())["pid"] for r in records}
    os.kill(pids["learner"], signal.SIGSTOP)
    try:
        paused_at = learner_steps(run_dir)
        time.sleep(20)  # the pause is the scenario: longer than control.timeout (10 s)
    finally:
        os.kill(pids["learner"], signal.SIGCONT)
    wait_until(lambda: learner_steps(run_dir) >= paused_at + 10, proc, "10 steps after the pause")
    events = read_jsonl(run_dir / "metrics" / "launcher.jsonl")
    assert not [e for e in events if e.get("event") == "restarted"], events
    assert all(psutil.pid_exists(pids[r]) for r in ("rollout-0", "rollout-1"))
    assert {r.stem: json.loads(r.read_text())["pid"] for r in records} == pids  # the same processes
    os.kill(proc.pid, signal.SIGINT)
    proc.wait(timeout=60)


def test_a_killed_shard_is_restarted_from_its_log_and_training_goes_on_exactly_once(tmp_path, process_reaper):
    """kill -9 the only buffer shard: the launcher starts it again on the same port from its log
    (recovered in well under a second), holding the leases it had granted again, so the
    learner's trained-but-unACKed leases are ACKed at its next checkpoint as if nothing had
    happened: no trajectory trained twice, no stale surge (what aged during the outage only)."""
    run_dir = tmp_path / "run"
    overrides = ("learner.total_steps=60", "learner.checkpoint_every=10", "learner.audit_consumed=true",
                 "buffer.capacity=2048")  # fmt: skip
    proc = start_run(run_dir, *overrides)
    process_reaper.append(proc)
    wait_until(lambda: learner_steps(run_dir) >= 25, proc, "25 learner steps")
    os.kill(json.loads((run_dir / "endpoints" / "buffer-0.json").read_text())["pid"], signal.SIGKILL)
    assert proc.wait(timeout=600) == 0, proc.stdout.read().decode()[-3000:] if proc.stdout else ""
    events = [e for e in read_jsonl(run_dir / "metrics" / "launcher.jsonl") if e.get("event") == "restarted"]
    assert [e["role"] for e in events] == ["buffer-0"]
    steps = read_jsonl(run_dir / "metrics" / "learner.jsonl")
    assert [s["version"] for s in steps] == list(range(1, 61))  # no restart of the learner
    trained = [i for r in read_jsonl(run_dir / "metrics" / "consumed.jsonl") for i in r["trained"]]
    assert len(trained) == len(set(trained)) == sum(s["samples"] for s in steps) == 60 * 128
    assert max(s["staleness_max"] for s in steps) <= 1 and steps[-1]["total_violations"] == 0
    assert steps[-1]["total_dropped_stale"] <= 3 * 128, [s["dropped_stale"] for s in steps]
    assert "leases held again" in (run_dir / "logs" / "buffer-0.log").read_text()
    assert "gone at ACK" not in (run_dir / "logs" / "learner.log").read_text()


def test_a_killed_learner_is_restarted_from_its_checkpoint_exactly_once_and_without_a_stale_surge(
    tmp_path, process_reaper
):
    """kill -9 the learner: the launcher restarts its group from the latest checkpoint while the
    shard keeps the data and rollouts come back; along the surviving lineage every trajectory is
    trained once, and admission counts the shard's backlog (before: 64-384 stale drops per step
    for the rest of the run)."""
    run_dir = tmp_path / "run"
    overrides = ("learner.total_steps=60", "learner.checkpoint_every=10", "learner.audit_consumed=true",
                 "buffer.capacity=2048")  # fmt: skip
    proc = start_run(run_dir, *overrides)
    process_reaper.append(proc)
    wait_until(lambda: learner_steps(run_dir) >= 25, proc, "25 learner steps")
    os.kill(json.loads((run_dir / "endpoints" / "learner.json").read_text())["pid"], signal.SIGKILL)
    assert proc.wait(timeout=600) == 0, proc.stdout.read().decode()[-3000:] if proc.stdout else ""
    events = read_jsonl(run_dir / "metrics" / "launcher.jsonl")
    assert [e["role"] for e in events if e.get("event") == "restarted" and e["role"] == "learner"] == [
        "learner"
    ]
    steps = read_jsonl(run_dir / "metrics" / "learner.jsonl")
    assert [s["version"] for s in steps] == list(range(1, 61))  # the resumed file: one lineage
    audit = read_jsonl(run_dir / "metrics" / "consumed.jsonl")
    cut = next(i for i, r in enumerate(audit) if "resumed_from" in r)
    resumed = audit[cut]["resumed_from"]
    assert resumed >= 20 and resumed % 10 == 0
    lineage = [r for r in audit[:cut] if r["version"] <= resumed] + audit[cut + 1 :]
    trained = [i for r in lineage for i in r["trained"]]
    assert len(trained) == len(set(trained)) == sum(s["samples"] for s in steps)
    assert sum(s["samples"] for s in steps) >= 60 * 128 - 2 * 128  # a lost lineage's samples are not trained
    last = steps[-1]
    assert last["total_violations"] == 0 and max(s["staleness_max"] for s in steps) <= 1
    assert last["total_dropped_stale"] <= 3 * 128, last["total_dropped_stale"]
