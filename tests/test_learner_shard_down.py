"""A learner whose checkpoints come while a shard is down for good: it trains on from the live
shard, ACKs what it trained there, keeps the dead shard's leases pending (in every checkpoint
and its acked.json) and ends its run with exit 0; a resume once the shard is back ACKs them,
so nothing is trained twice.

Before: the checkpoint's ACK of a step leased on the dead shard was retried for the client's
timeout (30 s), then raised, and the learner failed the run at its first checkpoint after the
shard died (learner/leases.py, `LeaseLedger.settle`; docs/architecture.md, "Checkpoints and
exactly-once"). The learner runs as a process (`sluice learner`); the test is the producer,
so it knows which shard holds every trajectory.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from test_resume import BATCH, GROUP, groups, start_learner, wait_for

from sluice.buffer.client import BufferClient
from sluice.metrics import read_jsonl
from sluice.net import free_port

STEPS, ON_DEAD, EVERY = 10, 5, 3  # steps 1-5 from the shard that dies; checkpoints at 3, 6, 9, 10
MORE = 2  # steps the resumed learner trains, from the live shard
LEASE_TIMEOUT_S = 4.0  # the learner's rule: a pending lease older than half of it makes a checkpoint due


def config_for(tmp_path: Path, endpoints: list[str], steps: int) -> Path:
    learner = {
        "total_steps": steps,
        "batch_size": BATCH,
        "max_staleness": 1000,
        "checkpoint_every": EVERY,
        "keep_checkpoints": 100,
        "resume": "auto",
        "audit_consumed": True,
        "get_wait_ms": 100,
    }
    config = {
        "run": {"dir": str(tmp_path / "run")},
        "model": {"init": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "head_dim": 16}},
        "buffer": {"endpoints": endpoints, "shards": 2, "lease_timeout_s": LEASE_TIMEOUT_S},
        "rollout": {"services": 0, "group_size": GROUP},
        "control": {"port": free_port()},
        "weight_sync": {"master_port": free_port()},
        "metrics": {"tensorboard": False},
        "learner": learner,
    }
    path = tmp_path / f"config-{steps}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
def test_a_learner_checkpointing_with_a_shard_down_for_good_trains_on_and_ends_cleanly(
    tmp_path, shard_factory, process_reaper
):
    live = shard_factory(lease_timeout_s=60.0)
    dead = shard_factory(log_dir=tmp_path / "dead-log", lease_timeout_s=60.0)  # durable: back later
    endpoints = [live.endpoint, dead.endpoint]
    run_dir, log = tmp_path / "run", tmp_path / "learner.log"
    metrics = run_dir / "metrics" / "learner.jsonl"
    on_dead = groups(0, ON_DEAD * BATCH // GROUP)  # steps 1-5, all from the shard that dies
    with BufferClient([dead.endpoint]) as client:
        client.put(on_dead)
    learner = start_learner(config_for(tmp_path, endpoints, STEPS), log, process_reaper)
    wait_for(lambda: len(read_jsonl(metrics)) >= ON_DEAD, learner, log, f"{ON_DEAD} steps")
    dead.close()  # for good, for this learner: steps 4 and 5 trained, their leases there not ACKed
    on_live = groups(1000, (STEPS + MORE - ON_DEAD) * BATCH // GROUP)
    live_client = BufferClient([live.endpoint])
    live_client.put(on_live[:BATCH])  # step 6, then its checkpoint
    acked_6 = run_dir / "checkpoints" / "step_000006" / "acked.json"
    wait_for(acked_6.exists, learner, log, "checkpoint 6's ACKs")  # (before: exit 1, after 30 s)
    time.sleep(LEASE_TIMEOUT_S)  # steps 4 and 5's leases, still pending, older than the rule's age
    live_client.put(on_live[BATCH : (STEPS - ON_DEAD) * BATCH])
    assert learner.wait(timeout=240) == 0, log.read_text()[-3000:]
    assert "wait for shard 1" in log.read_text()

    assert [s["version"] for s in read_jsonl(metrics)] == list(range(1, STEPS + 1))
    audit = [r for r in read_jsonl(run_dir / "metrics" / "consumed.jsonl") if "version" in r]
    trained_in = {r["version"]: set(r["trained"]) for r in audit}
    assert live_client.stats()[0].stats["acked"] == (STEPS - ON_DEAD) * BATCH  # all trained there
    # the checkpoints the steps made, and no more: the dead shard's old leases make none due
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert checkpoints == [f"step_{v:06d}" for v in (3, 6, 9, 10)], checkpoints
    # steps 4 and 5 are still pending after the last checkpoint's ACKs, for a resume to ACK
    acked = json.loads((run_dir / "checkpoints" / "step_000010" / "acked.json").read_text())
    assert {k for step in acked["pending"] for k, _ in step["leases"]} == {1}
    assert {i for step in acked["pending"] for i in step["traj_ids"]} == trained_in[4] | trained_in[5]

    dead.start()  # back from its log, its leases held again
    live_client.put(on_live[(STEPS - ON_DEAD) * BATCH :])
    resumed = start_learner(config_for(tmp_path, endpoints, STEPS + MORE), log, process_reaper)
    assert resumed.wait(timeout=240) == 0, log.read_text()[-3000:]
    with BufferClient([dead.endpoint]) as client:
        dead_stats = client.stats()[0].stats
    assert dead_stats["acked"] == 2 * BATCH and dead_stats["queued"] == dead_stats["leased"] == 0, dead_stats
    audit = [r for r in read_jsonl(run_dir / "metrics" / "consumed.jsonl") if "version" in r]
    trained = [i for r in audit for i in r["trained"]]
    assert len(trained) == len(set(trained)) == (STEPS + MORE) * BATCH  # none twice
    assert set(trained) == {t.traj_id for t in on_dead + on_live}
    live_client.close()
