"""Checkpoint and resume: kill -9 the learner, resume, and nothing leased is lost or trained twice.

The learner runs as a real process (`sluice learner`) against a buffer shard that outlives it;
the test is the producer, so it knows every trajectory id. The learner's audit trail
(`learner.audit_consumed`) lists the ids each step trained on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from sluice.buffer.client import BufferClient, LeasedBatch
from sluice.learner.leases import LeaseLedger
from sluice.metrics import read_jsonl
from sluice.net import free_port
from sluice.trajectory import Trajectory

ROOT = Path(__file__).resolve().parents[1]
BATCH, GROUP = 16, 4


def groups(start: int, n: int) -> list[Trajectory]:
    g = np.random.default_rng(start)
    out = []
    for k in range(start, start + n):
        for j in range(GROUP):
            c = g.integers(3, 13, size=int(g.integers(1, 6))).astype(np.int32)
            out.append(
                Trajectory(
                    traj_id=f"g{k}/{j}",
                    group_id=f"g{k}",
                    version=0,
                    group_size=GROUP,
                    reward=float(g.random()),
                    arrays={
                        "prompt_ids": np.asarray([1, 5, 6], np.int32),
                        "completion_ids": c,
                        "behaviour_logprobs": np.full(len(c), -1.0, np.float32),
                    },
                )
            )
    return out


def start_learner(config: Path, log: Path, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with log.open("ab") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", "sluice.cli", "learner", str(config), *overrides],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )


def wait_for(predicate, proc: subprocess.Popen, log: Path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "timed out; learner log:\n" + log.read_text()[-3000:]
        time.sleep(0.2)


@pytest.mark.slow
def test_kill_9_and_resume_loses_nothing_and_trains_nothing_twice(tmp_path, shard_factory, process_reaper):
    shard = shard_factory(lease_timeout_s=3.0)
    run_dir = tmp_path / "run"
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run": {"dir": str(run_dir)},
                "model": {
                    "init": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "head_dim": 16}
                },
                "buffer": {"endpoints": [shard.endpoint], "lease_timeout_s": 3.0},
                "rollout": {"services": 0, "group_size": GROUP},
                "control": {"port": free_port()},
                "weight_sync": {"master_port": free_port()},
                "metrics": {"tensorboard": False},
                "learner": {
                    "total_steps": 14,
                    "batch_size": BATCH,
                    "max_staleness": 1000,
                    "checkpoint_every": 3,
                    "resume": "auto",
                    "audit_consumed": True,
                    "get_wait_ms": 100,
                },
            }
        )
    )
    client = BufferClient([shard.endpoint])
    produced = groups(0, 8 * BATCH // GROUP + 2)  # 8 full steps, then half a batch: step 9 waits
    client.put(produced)
    log = tmp_path / "learner.log"
    metrics = run_dir / "metrics" / "learner.jsonl"

    first = start_learner(config, log)
    process_reaper.append(first)
    wait_for(
        lambda: len(read_jsonl(metrics)) >= 8 and (run_dir / "checkpoints" / "step_000006").is_dir(),
        first,
        log,
    )
    time.sleep(1.0)  # step 9's partial batch is leased by the prefetcher by now
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    # at the kill: steps 7 and 8 trained but not ACKed (their checkpoint would have been 9)
    leased = client.stats()[0].stats["leased"]
    assert leased == 2 * BATCH + 2 * GROUP, client.stats()[0].stats

    more = groups(1000, 6 * BATCH // GROUP)
    client.put(more)
    produced += more
    second = start_learner(config, log)
    process_reaper.append(second)
    assert second.wait(timeout=240) == 0, log.read_text()[-3000:]

    # the version sequence continues from the checkpoint, and so do the metrics
    steps = read_jsonl(metrics)
    assert [s["version"] for s in steps] == list(range(1, 15))
    assert (run_dir / "checkpoints" / "step_000014").is_dir()
    # exactly once along the surviving lineage: life 1 up to its checkpoint (v6), then life 2
    audit = read_jsonl(run_dir / "metrics" / "consumed.jsonl")
    cut = next(i for i, r in enumerate(audit) if "resumed_from" in r)
    assert audit[cut]["resumed_from"] == 6
    lineage = [r for r in audit[:cut] if r["version"] <= 6] + audit[cut + 1 :]
    trained = [i for r in lineage for i in r["trained"]]
    assert len(trained) == len(set(trained)) == 14 * BATCH
    redone = {i for r in audit[:cut] if r["version"] > 6 for i in r["trained"]}
    assert len(redone) == 2 * BATCH and redone <= set(trained)  # lost with life 1, trained again
    # nothing lost: every produced id was trained (and ACKed) or is still queued
    stats = client.stats()[0].stats
    assert stats["acked"] == len(trained)
    assert stats["queued"] + stats["leased"] == len(produced) - len(trained)
    assert set(trained) <= {t.traj_id for t in produced}
    client.close()


def test_ledger_skips_ids_whose_lease_was_lost(shard_factory):
    """A checkpoint lists leases trained since the previous one; if one is gone when it is
    ACKed (expired and requeued), its ids are skipped when they come back."""
    now = [0.0]
    shard = shard_factory(lease_timeout_s=5.0)
    shard.server.clock = lambda: now[0]
    client = BufferClient([shard.endpoint])
    try:
        client.put(groups(0, 2))
        first = client.get(GROUP, wait_ms=0)
        second = client.get(GROUP, wait_ms=0)
        ledger = LeaseLedger()
        ledger.add(first, [], 0.0)
        ledger.add(second, [], 0.0)
        state = json.loads(json.dumps(ledger.state_dict()))  # what a checkpoint stores
        client.ack(LeasedBatch(leases=first.leases))  # the dead learner ACKed the first lease ...
        now[0] = 10.0  # ... and the second expired before the resume
        client.stats()  # the shard expires leases on its next request
        resumed = LeaseLedger.from_state(state)
        acked, lost = resumed.settle(client)
        # the shard answers the first as already done (a replayed ACK); the second is gone
        assert acked == GROUP
        assert set(lost) == {t.traj_id for t in second.trajs}
        back = client.get(2 * GROUP, wait_ms=0)
        assert {t.traj_id for t in back.trajs} == {t.traj_id for t in second.trajs}  # redelivered
        keep, skipped = resumed.filter(back.trajs)
        assert keep == [] and len(skipped) == GROUP  # never trained twice
        resumed.add(back, skipped, 10.0)
        assert resumed.settle(client) == (GROUP, [])  # ACKed with its lease, and forgotten
        assert not (resumed.skip_ids & set(skipped))
    finally:
        client.close()
