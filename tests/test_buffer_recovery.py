"""kill -9 a real shard process mid-stream, restart it: every acknowledged trajectory is
delivered exactly once (ids and count checked), over ZeroMQ and over the same-host path."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from sluice.buffer.client import BufferClient, BufferError, BufferTimeout
from sluice.net import free_port
from sluice.trajectory import Trajectory

ROOT = Path(__file__).resolve().parents[1]
N_GROUPS = 400
GROUP_SIZE = 2


def group(i: int) -> list[Trajectory]:
    return [
        Trajectory(
            traj_id=f"g{i}/{j}",
            group_id=f"g{i}",
            version=0,
            group_size=GROUP_SIZE,
            arrays={"x": np.full(512, i, dtype=np.int32)},
        )
        for j in range(GROUP_SIZE)
    ]


def start_shard(config: Path, log: Path, reaper: list) -> subprocess.Popen:
    with log.open("ab") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sluice.cli", "buffer", str(config), "--shard", "0"],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    reaper.append(proc)
    return proc


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


TRANSPORT_SETTINGS = {
    "zmq": {"same_host_transport": "zmq"},
    "shm": {"same_host_transport": "auto", "same_host_min_put_bytes": 0},  # every PUT shared
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("transport", "pipelined"), [("shm", False), ("zmq", False), ("shm", True), ("zmq", True)]
)
def test_kill_9_mid_stream_then_every_acknowledged_trajectory_is_delivered_once(
    tmp_path, process_reaper, transport, pipelined
):
    """`pipelined`: the producer keeps PUTs in flight (PutPipeline: some are when the shard
    dies) and the consumer ACKs each batch with its next GET."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = tmp_path / "config.yaml"
    buffer = {
        "endpoints": [endpoint],
        "lease_timeout_s": 30,
        "fsync": "none",
        **TRANSPORT_SETTINGS[transport],
    }
    config.write_text(yaml.safe_dump({"run": {"dir": str(tmp_path / "run")}, "buffer": buffer}))
    log = tmp_path / "shard.log"
    shard = start_shard(config, log, process_reaper)

    put_acked: list[str] = []  # ids whose PUT the shard acknowledged
    delivered: list[str] = []  # ids whose lease the consumer ACKed successfully
    failures: list[BaseException] = []
    shared = {"put_bytes": 0, "got": 0}  # what went through shared memory
    stop = threading.Event()
    sent_count = [0]  # trajectories the producer sent (pipelined: not all answered yet)

    def produce() -> None:
        with BufferClient([endpoint], timeout_s=5, put_give_up_s=120) as client:
            if pipelined:
                sent: list[str] = []
                with client.pipeline(window=4) as pipe:
                    for i in range(N_GROUPS):
                        trajs = group(i)
                        pipe.put(trajs)  # answered later; failures retried (pinned) until stored
                        sent.extend(t.traj_id for t in trajs)
                        sent_count[0] = len(sent)
                        time.sleep(0.003)
                put_acked.extend(sent)  # (the pipeline's flush: every PUT was answered)
            else:
                for i in range(N_GROUPS):
                    trajs = group(i)
                    client.put(trajs)  # retries across the crash; raises only when giving up
                    put_acked.extend(t.traj_id for t in trajs)
                    sent_count[0] = len(put_acked)
                    time.sleep(0.003)
            shared["put_bytes"] = client.shared_put_bytes

    def consume() -> None:
        with BufferClient([endpoint], timeout_s=5) as client:
            used = None  # (pipelined: the batch to ACK with the next GET)
            while not stop.is_set():
                try:
                    batch = client.get(8, wait_ms=200, ack=used)
                except (BufferError, BufferTimeout):
                    used = None  # the lease died with the shard: these come back, unacknowledged
                    continue
                if used is not None:
                    delivered.extend(t.traj_id for t in used.trajs)
                    used = None
                if not batch.trajs:
                    continue
                time.sleep(0.02)  # slower than the producer: a backlog builds up
                if pipelined:
                    used = batch
                    continue
                try:
                    client.ack(batch)
                except (BufferError, BufferTimeout):
                    continue  # the lease died with the shard: these come back, unacknowledged
                delivered.extend(t.traj_id for t in batch.trajs)
                shared["got"] = client.shared_get_trajs
            if used is not None:
                client.ack(used)
                delivered.extend(t.traj_id for t in used.trajs)
            shared["got"] = client.shared_get_trajs

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - reported by the test below
                failures.append(e)

        return run

    threads = [threading.Thread(target=guarded(f), daemon=True) for f in (produce, consume)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: sent_count[0] >= N_GROUPS * GROUP_SIZE // 3 and delivered, 120, "traffic")
        assert sent_count[0] < N_GROUPS * GROUP_SIZE, "the stream ended before the kill"
        os.kill(shard.pid, signal.SIGKILL)
        assert shard.wait(timeout=10) == -signal.SIGKILL
        time.sleep(0.5)  # both sides run into the dead shard meanwhile
        start_shard(config, log, process_reaper)
        threads[0].join(timeout=180)
        assert not threads[0].is_alive(), "producer did not finish"
        wait_for(lambda: len(delivered) >= len(put_acked) or failures, 120, "every acknowledged id to arrive")
        time.sleep(0.5)  # anything delivered twice would show up now
    finally:
        stop.set()
        threads[1].join(timeout=30)
    assert not failures, failures
    assert len(put_acked) == N_GROUPS * GROUP_SIZE
    assert len(delivered) == len(set(delivered)), "a trajectory was delivered (and ACKed) twice"
    assert sorted(delivered) == sorted(put_acked)
    recovered = re.search(r"recovered (\d+) groups", log.read_text())
    assert recovered and int(recovered.group(1)) > 0, log.read_text()[-2000:]  # rebuilt from the log
    with BufferClient([endpoint], timeout_s=5) as client:
        stats = client.stats()[0].stats
        assert stats["held"] == 0 and stats["leased"] == 0
    if transport == "shm":  # most of the traffic (before and after the restart) was shared
        assert shared["put_bytes"] > N_GROUPS * GROUP_SIZE * 2048 // 2 and shared["got"] > N_GROUPS
    else:
        assert shared == {"put_bytes": 0, "got": 0}
