"""The one rule that splits a host's cores between roles (sluice/launch/threads.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.config.loader import load_config
from sluice.launch.threads import plan_threads, role_threads

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


def planned(cores: int, *overrides: str) -> tuple[int, int]:
    cfg = plan_threads(load_config(QUICKSTART, ["learner.device=cpu", *overrides]), cores)
    return cfg.learner.torch_threads, cfg.rollout.torch_threads


def test_cpu_rollouts_get_one_thread_and_the_learner_the_rest():
    assert planned(2, "rollout.engine=hf") == (1, 1)  # 2 services on 2 cores: never below 1
    assert planned(8, "rollout.engine=hf") == (6, 1)
    assert planned(8, "rollout.engine=hf", "learner.ranks=2") == (3, 1)


def test_sleeping_rollouts_leave_every_core_to_the_learner():
    assert planned(4, "rollout.engine=sim") == (4, 1)


def test_explicit_thread_counts_are_kept():
    assert planned(8, "rollout.engine=hf", "learner.torch_threads=3", "rollout.torch_threads=2") == (3, 2)


def test_a_role_started_alone_takes_omp_num_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert role_threads("auto") == 3 and role_threads(5) == 5
    monkeypatch.setenv("OMP_NUM_THREADS", "nonsense")
    assert role_threads("auto") >= 1


@pytest.mark.parametrize("bad", ["0", "-1", "lots"])
def test_bad_thread_counts_are_config_errors(bad):
    with pytest.raises(Exception, match="torch_threads"):
        load_config(QUICKSTART, [f"learner.torch_threads={bad}"])
