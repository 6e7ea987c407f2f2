"""Metrics every role writes: a Prometheus endpoint, a JSONL log, and an endpoint record.

No global state: each role owns a `CollectorRegistry` (not prometheus_client's default one), so
several roles in one process (tests run a shard, a control server and a service in threads)
never collide.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from prometheus_client import CollectorRegistry, start_http_server


@dataclass
class PrometheusEndpoint:
    """A registry served over HTTP at http://host:port/metrics (port 0 picks a free one)."""

    host: str = "127.0.0.1"
    port: int = 0
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    _server: Any = None

    def start(self) -> int:
        self._server, _ = start_http_server(self.port, addr=self.host, registry=self.registry)
        self.port = self._server.server_port
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class JsonlLog:
    """Append-only metrics log: one JSON object per line, flushed per line (tail-able)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fh: IO[str] = path.open("a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self.write_many([record])

    def write_many(self, records: list[dict[str, Any]]) -> None:
        """The records' lines in one write (a record's own "time" wins over now)."""
        if records:
            now = time.time()
            self._fh.write("".join(json.dumps({"time": now, **r}) + "\n" for r in records))

    def close(self) -> None:
        self._fh.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line being written right now
    return out


def record_endpoint(run_dir: Path, role: str, **info: Any) -> None:
    """Write <run_dir>/endpoints/<role>.json (metrics port, pid, ...) for `sluice status`."""
    d = run_dir / "endpoints"
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{role}.json.tmp"
    tmp.write_text(json.dumps({"role": role, "pid": os.getpid(), **info}))
    os.replace(tmp, d / f"{role}.json")
