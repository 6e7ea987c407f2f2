"""The chaos suite: under `sluice run`, kill -9 a rollout service, a shard and the learner, and
SIGSTOP a shard and the learner for 20 s; under `sluice ray`, kill -9 a shard and the learner
(the bounded form CI runs: `python tests/chaos/run.py --launcher both` runs every fault under
both). Each is a full run that must then account for every trajectory by id
(tests/chaos/harness.py says what is checked); the summary table is printed at the end."""

from __future__ import annotations

import pytest
from harness import FAULTS, Fault, run_with_fault

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.name.replace(" ", "_"))
def test_a_run_heals_itself_and_accounts_for_every_trajectory(fault: Fault, tmp_path, chaos_reports):
    report = run_with_fault("run", fault, tmp_path)
    chaos_reports.append(report)
    assert not report.failures(), report.as_dict()
    assert report.stored > 0 and report.trained >= 80 * 128 - 2 * 128  # (a lost lineage: retrained)


@pytest.mark.parametrize("fault", [Fault("kill", "buffer-0"), Fault("kill", "learner")], ids=lambda f: f.role)
def test_under_ray_a_killed_shard_or_learner_comes_back_on_its_node(fault: Fault, tmp_path, chaos_reports):
    pytest.importorskip("ray")
    report = run_with_fault("ray", fault, tmp_path)
    chaos_reports.append(report)
    assert not report.failures(), report.as_dict()
