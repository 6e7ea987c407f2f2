"""The chaos suite: under `sluice run`, kill -9 a rollout service, a shard and the learner, and
SIGSTOP a shard and the learner for 12 s; under `sluice ray`, kill -9 a rollout service, a shard
and then the learner in one run (the bounded form CI runs: `python tests/chaos/run.py --launcher
both` runs every fault under both). Each is a full run that must then account for every trajectory by id
(tests/chaos/harness.py says what is checked); the summary table is printed at the end."""

from __future__ import annotations

import pytest
from harness import FAULTS, Fault, run_with_fault, run_with_faults

from sluice.metrics import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.name.replace(" ", "_"))
def test_a_run_heals_itself_and_accounts_for_every_trajectory(fault: Fault, tmp_path, chaos_reports):
    report = run_with_fault("run", fault, tmp_path)
    chaos_reports.append(report)
    assert not report.failures(), report.as_dict()
    assert report.stored > 0 and report.trained >= 80 * 128 - 2 * 128  # (a lost lineage: retrained)
    if fault == Fault("stop", "learner"):  # the pause outlasted an ADMIT's time-out: re-sends ran
        said = "".join(log.read_text() for log in (tmp_path / "run" / "logs").glob("rollout-*.log"))
        assert "asking again" in said


def test_under_ray_a_killed_rollout_shard_and_learner_come_back_on_their_nodes(tmp_path, chaos_reports):
    """Three faults in one run (one Ray start and one run, not three): kill -9 rollout-0 at step
    20, the shard at step 35 once rollout-0 is back, the learner at step 55 once the shard is
    back. Steps take ~0.1 s, so the waits put the learner's kill near step 75 (at a checkpoint
    too: the versions logged must still run 1..N once); 120 steps leave room after it for the
    stale-drop rate to settle."""
    pytest.importorskip("ray")
    faults = [
        (20, Fault("kill", "rollout-0")),
        (35, Fault("kill", "buffer-0")),
        (55, Fault("kill", "learner")),
    ]
    report = run_with_faults("ray", faults, tmp_path, steps=120)
    chaos_reports.append(report)
    assert not report.failures(), report.as_dict()
    # the driver took the dead service out of weight sync (departed.py), and its replacement
    # generated with weights newer than those of the kill
    events = read_jsonl(tmp_path / "run" / "metrics" / "launcher.jsonl")
    back = next(e for e in events if e.get("event") == "restarted" and e["role"] == "rollout-0")
    assert back["left_weight_sync"] == ["default/rollout-0"], back
    batches = read_jsonl(tmp_path / "run" / "metrics" / "rollout-0.jsonl")
    assert max(r["version"] for r in batches if r["time"] > back["time"]) > 20
