"""Shared fixtures: in-thread shard and control servers, subprocess cleanup.

Servers in the test process bind `tcp://127.0.0.1:*` and tests read the port back
(`.endpoint`): nothing is picked first and bound later. Every socket is closed with linger 0 and
every thread or process a test starts is stopped in teardown, also when the test fails;
receives use timeouts, so a broken test fails, not hangs. Shared helpers are in tests/helpers/.
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
from helpers.lifetime import closing_all

from sluice.buffer.server import ShardServer
from sluice.config.buffer import BufferConfig
from sluice.control.admission import AdmissionPolicy
from sluice.control.client import ControlClient
from sluice.control.server import ControlServer

ROOT = Path(__file__).resolve().parents[1]
# Per-test time limits (pytest-timeout): `timeout` in pyproject.toml (120 s) for every test, and
# SLOW_TIMEOUT_S for a test marked slow, fitted to the slowest of them (~90 s) with margin for a
# loaded machine. A test that needs another limit says `@pytest.mark.timeout(N)` itself.
SLOW_TIMEOUT_S = 300


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


@pytest.fixture
def zmq_ctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


class RunningShard:
    """A shard server in a thread. `log_dir` makes it durable; `restart()` stops it and starts a
    new server on the same endpoint and log (what a restarted shard process does). A config
    endpoint `tcp://host:*` binds a free port, which `endpoint` (and `cfg`) then name."""

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
        if self.server.endpoint != self.endpoint:  # bound at `host:*`: a restart keeps the port
            self.endpoint = self.server.endpoint
            endpoints = self.cfg.all_endpoints()
            endpoints[self.shard] = self.endpoint
            self.cfg = self.cfg.model_copy(update={"endpoints": endpoints})

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
    """`make(log_dir=None, **buffer settings)`: a RunningShard on a free port; all closed at
    teardown."""

    def make(log_dir: Path | None = None, **overrides) -> RunningShard:
        cfg = BufferConfig(endpoints=["tcp://127.0.0.1:*"], **(TRANSPORT_CONFIG[transport] | overrides))
        return RunningShard(cfg, log_dir=log_dir)

    with closing_all(make) as factory:
        yield factory


@pytest.fixture
def env_factory() -> Iterator:
    """`make(cfg=None, **SyncEnv options)`: a learner's weight-sync side in this process
    (tests/helpers/weight_sync_env.py; `cfg` defaults to its `small_cfg()`); all closed at
    teardown."""
    from helpers.weight_sync_env import SyncEnv, small_cfg  # (torch: only where it is used)

    def make(cfg=None, **kwargs) -> SyncEnv:
        return SyncEnv(cfg or small_cfg(), **kwargs)

    with closing_all(make) as factory:
        yield factory


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


@pytest.fixture
def control() -> Iterator[tuple[ControlServer, ControlClient]]:
    """A control server in a thread (batch 8, max_staleness 0) and a client of it."""
    server = ControlServer(
        "tcp://127.0.0.1:*", AdmissionPolicy(batch_size=8, max_staleness=0), ctx=zmq.Context()
    )
    server.start()
    client = ControlClient(server.endpoint, timeout_s=5)
    yield server, client
    client.close()
    server.close()
