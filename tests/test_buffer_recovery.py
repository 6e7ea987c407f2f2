"""kill -9 a real shard process mid-stream, restart it: every acknowledged trajectory is
delivered exactly once (ids and count checked), over ZeroMQ and over the same-host path."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml
from helpers.groups import make_group
from helpers.procs import start
from helpers.wait import wait_until

from sluice.buffer.client import BufferClient, BufferError, BufferTimeout
from sluice.trajectory import Trajectory

ROOT = Path(__file__).resolve().parents[1]
N_GROUPS = 400
GROUP_SIZE = 2


def group(i: int) -> list[Trajectory]:
    return make_group(f"g{i}", GROUP_SIZE, nbytes=2048, fill=i)


def start_shard(config: Path, log: Path, reaper: list) -> subprocess.Popen:
    with log.open("ab") as fh:
        return start(["-m", "sluice.cli", "buffer", str(config), "--shard", "0"], reaper, stdout=fh)


def write_config(config: Path, endpoint: str, transport: str) -> None:
    buffer = {
        "endpoints": [endpoint],
        "lease_timeout_s": 30,
        "fsync": "none",
        **TRANSPORT_SETTINGS[transport],
    }
    config.write_text(yaml.safe_dump({"run": {"dir": str(config.parent / "run")}, "buffer": buffer}))


def bound_endpoint(config: Path, shard: subprocess.Popen, log: Path) -> str:
    """The address the shard process bound (it binds `host:*` and records what it got)."""
    record = config.parent / "run" / "endpoints" / "buffer-0.json"

    def alive() -> None:
        assert shard.poll() is None, log.read_text()[-2000:]

    wait_until(record.exists, 60, "the shard's endpoint record", check=alive)
    return json.loads(record.read_text())["endpoint"]


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
    config = tmp_path / "config.yaml"
    write_config(config, "tcp://127.0.0.1:*", transport)
    log = tmp_path / "shard.log"
    shard = start_shard(config, log, process_reaper)
    endpoint = bound_endpoint(config, shard, log)
    write_config(config, endpoint, transport)  # the restarted shard binds the same address

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
                        time.sleep(0.003)  # a paced stream: the kill lands in the middle of it
                put_acked.extend(sent)  # (the pipeline's flush: every PUT was answered)
            else:
                for i in range(N_GROUPS):
                    trajs = group(i)
                    client.put(trajs)  # retries across the crash; raises only when giving up
                    put_acked.extend(t.traj_id for t in trajs)
                    sent_count[0] = len(put_acked)
                    time.sleep(0.003)  # a paced stream: the kill lands in the middle of it
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
        wait_until(lambda: sent_count[0] >= N_GROUPS * GROUP_SIZE // 3 and delivered, 120, "traffic")
        assert sent_count[0] < N_GROUPS * GROUP_SIZE, "the stream ended before the kill"
        os.kill(shard.pid, signal.SIGKILL)
        assert shard.wait(timeout=10) == -signal.SIGKILL
        time.sleep(0.5)  # the shard stays down a while: both sides run into it (the scenario)
        start_shard(config, log, process_reaper)
        threads[0].join(timeout=180)
        assert not threads[0].is_alive(), "producer did not finish"
        wait_until(
            lambda: len(delivered) >= len(put_acked) or failures, 120, "every acknowledged id to arrive"
        )
        time.sleep(0.5)  # no event to wait for: a trajectory delivered twice would show up by now
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
