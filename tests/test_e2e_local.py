"""End to end: `sluice run` with real processes and real ZeroMQ on this machine."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest
from helpers import wait
from helpers.run_state import alive, port_is_free, role_pids, run_ports
from helpers.runs import learner_steps, sluice_run, start_run, wait_until

from sluice.metrics import read_jsonl

pytestmark = pytest.mark.slow


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
    # the training thread's CPU time is part of the compute phase's wall time
    assert all(0 < s["compute_cpu_s"] <= s["compute_s"] + 1e-3 for s in steps)
    # final checkpoint, loadable as a Hugging Face model
    from transformers import AutoModelForCausalLM

    ckpt = run_dir / "checkpoints" / "step_000150"
    assert (ckpt / "model.safetensors").is_file()
    AutoModelForCausalLM.from_pretrained(ckpt)
    # every role got and left its endpoints; no process or port is left behind
    assert {"learner", "buffer-0", "rollout-0", "rollout-1"} <= {
        p.stem for p in (run_dir / "endpoints").glob("*.json")
    }
    assert not [pid for pid in role_pids(run_dir).values() if psutil.pid_exists(pid)]
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
    # the weight-sync group alone would wait for the dead receiver's heartbeat (60 s here) or its
    # replacement's JOIN (~5 s); the launcher, which sees it die, takes it out at once (departed.py)
    slow_heartbeat = ("weight_sync.liveness_timeout_s=60", "weight_sync.publish_timeout_s=120")
    proc = start_run(run_dir, "learner.total_steps=100000", *slow_heartbeat)
    process_reaper.append(proc)
    record = run_dir / "endpoints" / "rollout-0.json"
    logs = [run_dir / "logs" / f"rollout-{i}.log" for i in (0, 1)]
    # one service alone can feed the first steps while the other is still starting (a loaded
    # machine): both must be members of one weight-sync epoch, or there is nothing for the
    # launcher to take out (one CI run killed rollout-0 while it still waited for its first
    # weights), or the kill lands while the learner forms the epoch that adds rollout-1 (one CI
    # run: the group's formation then waits its connect timeout, 10 s, for the dead member:
    # bounded by design, docs/architecture.md, Weight sync, "Failures never hang the learner")
    wait_until(
        lambda: (
            learner_steps(run_dir) >= 5
            and record.exists()
            and all(log.exists() and "of 3 in epoch" in log.read_text() for log in logs)
        ),
        proc,
        "5 learner steps, both rollouts members of one weight-sync epoch",
    )

    # kill -9 a rollout service: the launcher starts it again and training goes on
    killed = json.loads(record.read_text())["pid"]
    killed_at = time.time()
    os.kill(killed, signal.SIGKILL)
    events = run_dir / "metrics" / "launcher.jsonl"
    wait_until(lambda: any(e.get("event") == "restarted" for e in read_jsonl(events)), proc, "a restart")
    restarted = next(e for e in read_jsonl(events) if e.get("event") == "restarted")
    assert (
        restarted["role"] == "rollout-0" and restarted["rc"] == -signal.SIGKILL and restarted["restarts"] == 1
    )
    assert restarted["left_weight_sync"] == ["default/rollout-0"]
    wait_until(
        lambda: json.loads(record.read_text())["pid"] == restarted["pid"], proc, "the new rollout-0 serving"
    )
    steps = learner_steps(run_dir)
    wait_until(lambda: learner_steps(run_dir) >= steps + 5, proc, "5 more learner steps")
    times = [s["time"] for s in read_jsonl(run_dir / "metrics" / "learner.jsonl")]
    since = [t for t in times if t > killed_at]
    before = [t for t in times if t <= killed_at][-1:]  # the learner's gap across the kill, and after
    assert max(b - a for a, b in zip(before + since, since)) < 3, "the learner waited for the dead rollout"

    pids = list(role_pids(run_dir).values())
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


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_launcher_killed_by_sigkill_takes_every_role_with_it(tmp_path, process_reaper, start_method):
    """No orphans even when the launcher gets no chance to stop anything: spawned roles get
    their parent-death signal, and forked ones (launch/forkserver.py) get it once the fork
    server ends with the launcher. Every role stops at once, shards included, so the learner's
    last ACKs and NACKs may find no shard: it gives up their retries once it is stopping."""
    run_dir = tmp_path / "run"
    proc = start_run(run_dir, "learner.total_steps=100000", f"run.start_method={start_method}")
    process_reaper.append(proc)
    wait_until(lambda: learner_steps(run_dir) >= 3 and len(role_pids(run_dir)) == 4, proc, "3 learner steps")
    pids = role_pids(run_dir)
    # a forked role names itself as the spawned command does (ps, top, pkill -f)
    cmdline = " ".join(psutil.Process(pids["rollout-1"]).cmdline())
    assert "-m sluice.cli rollout --index 1" in cmdline, cmdline
    assert os.getsid(pids["rollout-1"]) == pids["rollout-1"]  # a session of its own, as a spawned role
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)

    def survivors() -> list[str]:
        return [name for name, pid in pids.items() if alive(pid)]

    wait.wait_until(lambda: not survivors(), 20, lambda: f"every role gone (alive: {survivors()})")
    wait.wait_until(lambda: all(port_is_free(p) for p in run_ports(run_dir)), 10, "the run's ports free")
