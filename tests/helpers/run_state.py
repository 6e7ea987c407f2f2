"""What a run left behind: its role processes (by the endpoints they recorded), the ports its
config names, for the tests that check nothing outlives a run, and its launcher's events."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import psutil
import yaml


def role_pids(run_dir: Path) -> dict[str, int]:
    """Role name -> the pid its endpoint record names (the newest incarnation's)."""
    return {p.stem: json.loads(p.read_text())["pid"] for p in (run_dir / "endpoints").glob("*.json")}


def launcher_events(run_dir: Path, kind: str) -> list[dict]:
    """The launcher's `kind` events (placed, exit, restarted, ...), in order."""
    from sluice.metrics import read_jsonl

    return [e for e in read_jsonl(run_dir / "metrics" / "launcher.jsonl") if e.get("event") == kind]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def run_ports(run_dir: Path) -> list[int]:
    """The shards', the weight-sync store's, the control plane's and every role's metrics port."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    ports = [int(ep.rsplit(":", 1)[1]) for ep in cfg["buffer"]["endpoints"]]
    ports += [int(cfg["weight_sync"]["master_port"]), int(cfg["control"]["port"])]
    for rec in (run_dir / "endpoints").glob("*.json"):
        ports.append(json.loads(rec.read_text())["metrics_port"])
    return ports


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
