"""A learner's weight-sync side in the test process: control server + broadcaster, plus
receiver threads or real receiver processes (`python -m sluice.weight_sync.probe`). Everything is
closed at teardown, also when the test fails."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import zmq

from helpers.procs import child_env
from helpers.wait import wait_until
from sluice.config.weight_sync import WeightSyncConfig
from sluice.control.admission import AdmissionPolicy
from sluice.control.server import ControlServer
from sluice.net import free_port
from sluice.weight_sync.broadcaster import WeightBroadcaster
from sluice.weight_sync.probe import digest
from sluice.weight_sync.receiver import WeightReceiver

ROOT = Path(__file__).resolve().parents[2]


def model_digest(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> str:
    """What a receiver's probe reports for this model's weights on the wire."""
    return digest([(n, p.detach().to(dtype)) for n, p in model.named_parameters()])


class ProbeProcess:
    """A receiver in its own process; its reported versions are read from stdout."""

    def __init__(self, cfg: WeightSyncConfig, control_endpoint: str, service_id: str, log_dir: Path) -> None:
        self.service_id = service_id
        self.log_path = log_dir / f"{service_id}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sluice.weight_sync.probe",
                f"--master-port={cfg.master_port}",
                f"--control={control_endpoint}",
                f"--service-id={service_id}",
                f"--publish-timeout-s={cfg.publish_timeout_s}",
                f"--ready-timeout-s={cfg.ready_timeout_s}",
                "--timeout-s=60",
            ],
            cwd=ROOT,
            env=child_env(OMP_NUM_THREADS="1"),
            stdout=subprocess.PIPE,
            stderr=self._log,
            start_new_session=True,
        )
        self.versions: list[dict] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.versions.append(json.loads(line))
                self._cond.notify_all()

    def wait_version(self, version: int, timeout_s: float = 30.0) -> dict:
        with self._cond:
            ok = self._cond.wait_for(
                lambda: any(v["version"] >= version for v in self.versions), timeout=timeout_s
            )
            assert ok, f"{self.service_id} did not report v{version}: {self.log_tail()}"
            return next(v for v in self.versions if v["version"] >= version)

    def log_tail(self) -> str:
        return self.log_path.read_text()[-3000:] if self.log_path.exists() else ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill(signal.SIGCONT)
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill(signal.SIGKILL)
                self.proc.wait()
        self._log.close()


class SyncEnv:
    def __init__(self, cfg: WeightSyncConfig, broadcaster_cls=WeightBroadcaster, **kwargs) -> None:
        self.cfg = cfg
        self.control = ControlServer("tcp://127.0.0.1:*", AdmissionPolicy(8, 1), ctx=zmq.Context())
        self.control_endpoint = self.control.endpoint
        self.broadcaster = broadcaster_cls(cfg, torch.device("cpu"), **kwargs)
        self.control.start()
        self.broadcaster.start(self.control, self.control_endpoint)
        self.receivers: list[WeightReceiver] = []
        self.probes: list[ProbeProcess] = []

    def receiver(self, service_id: str, **kwargs) -> WeightReceiver:
        r = WeightReceiver(self.cfg, service_id=service_id, control_endpoint=self.control_endpoint, **kwargs)
        self.receivers.append(r)
        r.start()
        return r

    def probe(self, service_id: str, log_dir: Path) -> ProbeProcess:
        p = ProbeProcess(self.cfg, self.control_endpoint, service_id, log_dir)
        self.probes.append(p)
        return p

    def wait_members(self, n: int, timeout_s: float = 30.0) -> None:
        """Until n services are registered (joined; they enter the group at the next publish)."""
        registered = self.broadcaster.membership.registered
        wait_until(lambda: registered() >= n, timeout_s, lambda: f"{n} joined (only {registered()} did)")

    def close(self) -> None:
        self.broadcaster.close(leave_wait_s=1.0)
        for r in self.receivers:
            r.stop()
        for p in self.probes:
            p.close()
        self.control.close()
        for r in self.receivers:
            assert not r._thread.is_alive(), f"{r.service_id}: receiver thread did not stop"


def small_cfg(**overrides) -> WeightSyncConfig:
    """Small buckets and short timeouts. `confirm: wait` and `send: inline` (publish returns
    once every member verified) unless a test asks for `background`: most tests check what
    members hold right after a publish."""
    base = dict(
        master_port=free_port(), timeout_s=30, publish_timeout_s=10, ready_timeout_s=5, bucket_mb=0.05,
        confirm="wait", send="inline",
    )  # fmt: skip
    return WeightSyncConfig(**{**base, **overrides})


def perturb(model: torch.nn.Module, scale: float = 0.1) -> None:
    """What a training step does: every parameter changes."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)


def wait_version(receiver: WeightReceiver, version: int, timeout_s: float = 20.0):
    """The first verified version >= `version` the receiver hands out (older ones skipped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = receiver.wait_for_weights(timeout_s=max(0.0, deadline - time.monotonic()))
        if got is not None and got.version >= version:
            return got
    raise AssertionError(f"{receiver.service_id} did not get v{version} (holds v{receiver.version})")
