"""The chaos suite under `sluice run`: kill -9 a rollout service, a shard and the learner, and
SIGSTOP a shard and the learner for 20 s, each in a full run that must then account for every
trajectory by id (tests/chaos/harness.py says what is checked). The summary table is printed at
the end of the session; `python tests/chaos/run.py --launcher ray` runs the same under Ray."""

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
