"""Operations commands and per-role launch behaviour: config, keys, status, signals, exit codes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import yaml
from helpers.procs import start
from helpers.wait import running, wait_until

from sluice.buffer.client import BufferClient
from sluice.net import free_port

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")


def sluice(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sluice.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_config_command_applies_env_then_command_line():
    proc = sluice(
        "config",
        QUICKSTART,
        "learner.lr=2e-5",
        env={"SLUICE__LEARNER__LR": "1e-5", "SLUICE__CONTROL__PORT": "5600"},
    )
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["learner"]["lr"] == 2e-5 and cfg["control"]["port"] == 5600


def test_bad_env_override_is_a_one_line_error_naming_key_and_variable():
    proc = sluice("learner", QUICKSTART, env={"SLUICE__LEARNER__LOSS__TYPE": "nope"})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert (
        "learner.loss.type" in lines[0] and "'grpo'" in lines[0] and "SLUICE__LEARNER__LOSS__TYPE" in lines[0]
    )
    bad_index = sluice("buffer", QUICKSTART, env={"SLUICE_INDEX": "first"})
    assert bad_index.returncode == 2 and "SLUICE_INDEX='first'" in bad_index.stderr


def test_keys_command(tmp_path):
    proc = sluice("keys", str(tmp_path / "k"))
    assert proc.returncode == 0, proc.stderr
    assert "security.curve=true" in proc.stdout and (tmp_path / "k" / "authorized" / "client.key").is_file()
    again = sluice("keys", str(tmp_path / "k"))
    assert again.returncode == 2 and "--overwrite" in again.stderr


def test_status_of_a_run_that_is_not_up(tmp_path):
    (tmp_path / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "run": {"dir": str(tmp_path)},
                "buffer": {"endpoints": [f"tcp://127.0.0.1:{free_port()}"]},
                "control": {"port": free_port()},
            }
        )
    )
    proc = sluice("status", str(tmp_path), "--json", "--timeout", "0.5")
    assert proc.returncode == 1, proc.stderr
    snap = json.loads(proc.stdout)
    assert {r["role"]: r["state"] for r in snap["rows"]} == {
        "learner": "unreachable",
        "buffer-0": "unreachable",
        "rollout-0": "unreachable",
        "rollout-1": "unreachable",
    }
    table = sluice("status", str(tmp_path), "--once", "--timeout", "0.5")
    assert (
        table.returncode == 1
        and "unreachable" in table.stdout
        and "control plane unreachable" in table.stdout
    )
    unresolved = sluice("status", QUICKSTART, "--once")
    assert unresolved.returncode == 2 and "control.port is 0" in unresolved.stderr


def test_role_process_from_env_serves_and_stops_cleanly_on_sigterm(tmp_path, process_reaper):
    """What systemd, Slurm or Kubernetes do: config file + environment, then SIGTERM."""
    proc = start(
        ["-m", "sluice.cli", "buffer", QUICKSTART],
        process_reaper,
        SLUICE__RUN__DIR=str(tmp_path),
        SLUICE__BUFFER__ENDPOINTS=json.dumps(["tcp://127.0.0.1:*"]),  # binds a free port, records it
        SLUICE_INDEX="0",
    )
    path = tmp_path / "endpoints" / "buffer-0.json"
    alive = running({"sluice buffer": proc}, lambda _: proc.stdout.read().decode()[-2000:])
    wait_until(path.exists, 60, "the shard's endpoint record", check=alive)
    record = json.loads(path.read_text())
    assert record["pid"] == proc.pid and record["metrics_port"] > 0
    endpoint = record["endpoint"]
    port = int(endpoint.rsplit(":", 1)[1])
    with BufferClient([endpoint], timeout_s=2) as client:
        wait_until(lambda: client.ping(timeout_s=1.0), 60, "the shard answering", interval_s=0, check=alive)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    with socket.socket() as s:  # the shard's port is free again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
