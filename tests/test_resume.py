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
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers.groups import group_of
from helpers.procs import start
from helpers.wait import running, wait_until

from sluice.buffer.client import BufferClient, LeasedBatch
from sluice.learner.leases import LeaseLedger
from sluice.metrics import read_jsonl
from sluice.net import free_port
from sluice.trajectory import Trajectory

ROOT = Path(__file__).resolve().parents[1]
BATCH, GROUP = 16, 4


def groups(start: int, n: int) -> list[Trajectory]:
    """Groups g<start> .. g<start+n-1> of GROUP LLM samples (random completions and rewards)."""
    g = np.random.default_rng(start)
    out = []
    prompt = np.asarray([1, 5, 6], np.int32)
    for k in range(start, start + n):
        completions = [g.integers(3, 13, size=int(g.integers(1, 6))).astype(np.int32) for _ in range(GROUP)]
        arrays = [
            {
                "prompt_ids": prompt,
                "completion_ids": c,
                "behaviour_logprobs": np.full(len(c), -1.0, np.float32),
            }
            for c in completions
        ]
        out += group_of(f"g{k}", arrays, rewards=g.random(GROUP).tolist())
    return out


def start_learner(config: Path, log: Path, reaper: list) -> subprocess.Popen:
    with log.open("ab") as fh:
        return start(["-m", "sluice.cli", "learner", str(config)], reaper, stdout=fh, OMP_NUM_THREADS="1")


def wait_for(predicate, proc: subprocess.Popen, log: Path, what: str, timeout: float = 180.0) -> None:
    """Poll `predicate` while the learner lives; its log's end on failure."""

    def tail(*_: str) -> str:
        return "learner log:\n" + log.read_text()[-3000:]

    check = running({"learner": proc}, tail)
    wait_until(predicate, timeout, lambda: f"{what}; {tail()}", interval_s=0.2, check=check)


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

    first = start_learner(config, log, process_reaper)
    wait_for(
        lambda: len(read_jsonl(metrics)) >= 8 and (run_dir / "checkpoints" / "step_000006").is_dir(),
        first,
        log,
        "8 learner steps and the checkpoint of step 6",
    )
    # steps 7 and 8 trained but not ACKed (their checkpoint would have been 9), and step 9's
    # partial batch leased by the prefetcher

    def leased() -> bool:
        return client.stats()[0].stats["leased"] == 2 * BATCH + 2 * GROUP

    wait_for(leased, first, log, "steps 7, 8 and the partial batch of step 9 leased")
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    assert leased(), client.stats()[0].stats  # (as at the kill: nothing was settled since)

    more = groups(1000, 6 * BATCH // GROUP)
    client.put(more)
    produced += more
    second = start_learner(config, log, process_reaper)
    assert second.wait(timeout=240) == 0, log.read_text()[-3000:]

    # the version sequence continues from the checkpoint, and so do the metrics
    steps = read_jsonl(metrics)
    assert [s["version"] for s in steps] == list(range(1, 15))
    # a checkpoint holds its own step's totals (recorded before it is written), so none is lost
    assert steps[-1]["total_samples"] == 14 * BATCH
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


def test_ids_queued_again_before_their_ack_are_not_trained_twice(shard_factory):
    """A trained lease, held for the next checkpoint, ends at the shard before its ACK (it
    expired; a restarted shard that could not log it does the same) and its groups come back:
    the ledger skips them; the skipped copies are ACKed with their new lease, and the old
    lease's ACK then fails and is forgotten: trained once, lost never."""
    now = [0.0]
    shard = shard_factory(lease_timeout_s=5.0)
    shard.server.clock = lambda: now[0]
    client = BufferClient([shard.endpoint], timeout_s=5)
    try:
        client.put(groups(0, 1))
        trained = client.get(GROUP, wait_ms=0)
        ledger = LeaseLedger()
        keep, skipped = ledger.filter(trained.trajs)
        assert len(keep) == GROUP and skipped == []
        ledger.add(trained, skipped, 0.0)  # trained; ACKed at the next checkpoint
        now[0] = 10.0  # the lease ends at the shard
        client.stats()  # (the shard expires leases as it serves)
        back = client.get(GROUP, wait_ms=0)
        assert {t.traj_id for t in back.trajs} == {t.traj_id for t in trained.trajs}
        keep, skipped = ledger.filter(back.trajs)
        assert keep == [] and len(skipped) == GROUP  # not trained again
        ledger.add(back, skipped, 1.0)
        acked, lost = ledger.settle(client)  # the checkpoint's ACKs: the first lease is gone
        assert acked == GROUP and set(lost) == {t.traj_id for t in trained.trajs}
        assert not ledger.skip_ids  # the copies were ACKed with their own lease: nothing left
        assert client.stats()[0].stats["held"] == 0
    finally:
        client.close()
