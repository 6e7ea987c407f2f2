"""The chaos suite: under `sluice run`, SIGSTOP a shard and the learner for 12 s, one run each,
and kill -9 a shard with checkpoints off (the lease ACKs ride on the learner's GETs); under
`sluice run` and under `sluice ray`, kill -9 a rollout service, a shard and then the learner in
one run (the bounded form CI runs: `python tests/chaos/run.py --launcher both` runs every fault
alone under both). Each is a full run that must then account for every trajectory
by id (tests/chaos/harness.py says what is checked); the summary table is printed at the end."""

from __future__ import annotations

import pytest
from harness import FAULTS, Fault, run_with_fault, run_with_faults
from helpers.run_state import launcher_events

from sluice.metrics import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


PAUSES = [f for f in FAULTS if f.kind == "stop"]
KILLS = [  # each once the one before is back
    (20, Fault("kill", "rollout-0")),
    (35, Fault("kill", "buffer-0")),
    (55, Fault("kill", "learner")),
]


@pytest.mark.parametrize("fault", PAUSES, ids=lambda f: f.name.replace(" ", "_"))
def test_a_paused_role_costs_no_restart_and_every_trajectory_is_accounted_for(
    fault: Fault, tmp_path, chaos_reports
):
    report = run_with_fault("run", fault, tmp_path)
    chaos_reports.append(report)
    assert not report.failures(), report.as_dict()
    assert report.stored > 0 and report.trained == 80 * 128
    if fault == Fault("stop", "learner"):  # the pause outlasted an ADMIT's time-out: re-sends ran
        said = "".join(log.read_text() for log in (tmp_path / "run" / "logs").glob("rollout-*.log"))
        assert "asking again" in said


def test_a_killed_shard_with_checkpoints_off_holds_no_ack_and_loses_nothing(tmp_path, chaos_reports):
    """With checkpoints off, a step's ACKs ride on the batch prefetch's GET (learner/source.py):
    kill -9 one of the two shards, and the steps leased on it wait (pending) for its restart
    while the batches keep coming; nothing is lost or trained twice, and no ACK gives up."""
    fault = Fault("kill", "buffer-0")
    report = run_with_fault("run", fault, tmp_path, extra=("learner.checkpoint_every=0",))
    chaos_reports.append(report)
    assert not report.failures(), report.as_dict()
    assert report.restarted == ["buffer-0"] and report.trained == 80 * 128


@pytest.mark.parametrize("launcher", ["run", "ray"])
def test_a_killed_rollout_shard_and_learner_come_back_and_every_trajectory_is_accounted_for(
    launcher: str, tmp_path, chaos_reports
):
    """Three faults in one run (one start and one run, not three): kill -9 rollout-0 at step 20,
    the shard at step 35 once rollout-0 is back, the learner at step 55 once the shard is back.
    Steps take ~0.1 s, so the waits can put the learner's kill near step 75 (at a checkpoint
    too: the versions logged must still run 1..N once); 120 steps leave room after it for the
    stale-drop rate to settle."""
    if launcher == "ray":
        pytest.importorskip("ray")
    report = run_with_faults(launcher, KILLS, tmp_path, steps=120)
    chaos_reports.append(report)
    assert not report.failures(), report.as_dict()
    # every version trained a whole batch, topped up past the samples of the lost lineage (made,
    # before the learner's kill, by weights its resume lost); what it did not train is what the
    # learner counted out: samples beyond the bound (none) and trained before (a lease lost at
    # its ACK)
    last = read_jsonl(tmp_path / "run" / "metrics" / "learner.jsonl")[-1]
    not_trained = last["total_violations"] + last["total_skipped"]
    assert report.stored > 0 and report.trained == 120 * 128 - not_trained, last
    # the launcher took the dead service out of weight sync (departed.py), and its replacement
    # generated with weights newer than those of the kill
    back = next(e for e in launcher_events(tmp_path / "run", "restarted") if e["role"] == "rollout-0")
    assert back["left_weight_sync"] == ["default/rollout-0"], back
    batches = read_jsonl(tmp_path / "run" / "metrics" / "rollout-0.jsonl")
    assert max(r["version"] for r in batches if r["time"] > back["time"]) > 20
