"""The chaos suite: under `sluice run`, kill -9 a rollout service, a shard and the learner, and
SIGSTOP a shard and the learner for 20 s; under `sluice ray`, kill -9 a shard and then the learner
in one run (the bounded form CI runs: `python tests/chaos/run.py --launcher both` runs every fault under
both). Each is a full run that must then account for every trajectory by id
(tests/chaos/harness.py says what is checked); the summary table is printed at the end."""

from __future__ import annotations

import pytest
from harness import FAULTS, Fault, run_with_fault, run_with_faults

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.name.replace(" ", "_"))
def test_a_run_heals_itself_and_accounts_for_every_trajectory(fault: Fault, tmp_path, chaos_reports):
    report = run_with_fault("run", fault, tmp_path)
    chaos_reports.append(report)
    assert not report.failures(), report.as_dict()
    assert report.stored > 0 and report.trained >= 80 * 128 - 2 * 128  # (a lost lineage: retrained)


def test_under_ray_a_killed_shard_and_then_learner_come_back_on_their_nodes(tmp_path, chaos_reports):
    """Both faults in one run (one Ray start and one run, not two): the learner is killed at
    step 50, once the shard killed at step 30 is back."""
    pytest.importorskip("ray")
    report = run_with_faults(
        "ray", [(30, Fault("kill", "buffer-0")), (50, Fault("kill", "learner"))], tmp_path
    )
    chaos_reports.append(report)
    assert not report.failures(), report.as_dict()
