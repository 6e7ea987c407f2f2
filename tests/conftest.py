"""Shared fixtures: free ports, in-thread shard servers, subprocess cleanup.

Every socket is closed with linger 0 and every thread or process a test starts is stopped in
teardown, also when the test fails; receives use timeouts, so a broken test fails, not hangs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from sluice.buffer.server import ShardServer
from sluice.config.buffer import BufferConfig
from sluice.net import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def zmq_ctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


class RunningShard:
    """A shard server in a thread. `log_dir` makes it durable; `restart()` stops it and starts a
    new server on the same endpoint and log (what a restarted shard process does)."""

    def __init__(self, cfg: BufferConfig, shard: int = 0, clock=None, log_dir: Path | None = None) -> None:
        self.cfg = cfg
        self.shard = shard
        self.clock = clock
        self.log_dir = log_dir
        self.endpoint = cfg.endpoint(shard)
        self.thread: threading.Thread | None = None
        self.start()

    def start(self) -> None:
        kwargs = {"clock": self.clock} if self.clock is not None else {}
        self.ctx = zmq.Context()
        self.server = ShardServer(self.cfg, self.shard, ctx=self.ctx, log_dir=self.log_dir, **kwargs)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.server.serve, args=(self.stop,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        if self.thread is None:
            return
        self.stop.set()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive(), "shard thread did not stop"
        self.thread = None
        self.ctx.term()

    def restart(self) -> None:
        self.close()
        self.start()


TRANSPORT_CONFIG = {
    # every byte over ZeroMQ
    "zmq": {"same_host_transport": "zmq"},
    # same-host shared memory for every PUT (however small) and every GET/SAMPLE
    "shm": {"same_host_transport": "auto", "same_host_min_put_bytes": 0},
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test module with `TRANSPORTS = [...]` runs its shard tests once per transport."""
    transports = getattr(metafunc.module, "TRANSPORTS", None)
    if transports and "transport" in metafunc.fixturenames:
        metafunc.parametrize("transport", transports, indirect=True)


@pytest.fixture
def transport(request: pytest.FixtureRequest) -> str:
    """How shards made by `shard_factory` move payload bytes to same-host clients (default:
    shared memory, as a default config does)."""
    return getattr(request, "param", "shm")


@pytest.fixture
def shard_factory(transport: str) -> Iterator:
    started: list[RunningShard] = []

    def make(log_dir: Path | None = None, **overrides) -> RunningShard:
        overrides = TRANSPORT_CONFIG[transport] | overrides
        cfg = BufferConfig(endpoints=[f"tcp://127.0.0.1:{free_port()}"], **overrides)
        shard = RunningShard(cfg, log_dir=log_dir)
        started.append(shard)
        return shard

    yield make
    for s in started:
        s.close()


@pytest.fixture
def process_reaper() -> Iterator[list[subprocess.Popen]]:
    """Register Popen objects (started with start_new_session=True); their process groups are
    killed at teardown."""
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        p.wait()
