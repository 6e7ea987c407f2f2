"""benchmarks/trl_parity.py: Sluice's learner takes TRL's step on a batch TRL generated, and the
check fails where the two objectives differ (it would not pass whatever the learner did)."""

from __future__ import annotations

import json

import pytest
from helpers.bench_scripts import ROOT


@pytest.fixture
def parity(monkeypatch):
    pytest.importorskip("trl")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import trl_parity

    return trl_parity


@pytest.mark.slow  # two GRPOTrainer steps and two Sluice steps (~30 s)
def test_sluice_takes_trls_step_and_a_different_objective_is_caught(parity, tmp_path):
    assert parity.main(["--seeds", "0", "--out", str(tmp_path / "same")]) == 0
    (same,) = json.loads((tmp_path / "same" / "trl_parity.json").read_text())["results"]
    assert same["sequences"] == 64 and same["groups_with_signal"] > 0
    assert same["advantage_max_abs_diff"] <= parity.ADV_TOL
    assert same["clipped_grad_rel_l2"] <= parity.GRAD_TOL
    assert same["params_differing_share"] < 1e-3  # lr x sign(g): only g within rounding of 0
    # A group std floor of 1e-2, not TRL's hard-coded 1e-4: the check must catch it.
    args = ["--seeds", "0", "--out", str(tmp_path / "other"), "--sluice-override"]
    grpo_eps_1e2 = (
        "workflow.learner=[{stage: group_advantages, normalize_std: true, eps: 0.01},"
        " {stage: policy_loss, loss: {type: grpo, is_cap: 2.0}, aggregation: token}]"
    )
    assert parity.main([*args, grpo_eps_1e2]) == 1
    (other,) = json.loads((tmp_path / "other" / "trl_parity.json").read_text())["results"]
    assert other["advantage_max_abs_diff"] > parity.ADV_TOL and not other["ok"]
    assert other["clipped_grad_rel_l2"] > parity.GRAD_TOL
