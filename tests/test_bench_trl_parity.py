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


def check(parity, tmp_path, name: str, *args: str) -> tuple[int, dict]:
    out = tmp_path / name
    rc = parity.main(["--seeds", "0", "--out", str(out), *args])
    (result,) = json.loads((out / "trl_parity.json").read_text())["results"]
    return rc, result


@pytest.mark.slow  # four runs of a few GRPOTrainer and Sluice steps each (~20 s)
def test_sluice_takes_trls_steps_and_a_different_objective_or_optimiser_is_caught(parity, tmp_path):
    rc, same = check(parity, tmp_path, "same", "--steps", "10")
    assert rc == 0 and same["ok"]
    assert same["steps"] == 10 and same["sequences_per_step"] == 64 and same["groups_with_signal"] > 0
    # some groups scored alike, so Sluice left rows out of its steps (learner.skip_zero_advantage)
    assert same["groups_with_signal"] < 10 * 8
    assert same["advantage_max_abs_diff"] <= parity.ADV_TOL
    assert same["clipped_grad_rel_l2"] <= parity.GRAD_TOL
    assert same["update_rel_l2"] <= parity.UPDATE_TOL
    assert same["params_differing_share"] < 1e-3  # lr x sign(g): only g within rounding of 0
    # A group std floor of 1e-2, not TRL's hard-coded 1e-4: the check must catch it.
    grpo_eps_1e2 = (
        "workflow.learner=[{stage: group_advantages, normalize_std: true, eps: 0.01},"
        " {stage: policy_loss, loss: {type: grpo, is_cap: 2.0}, aggregation: token}]"
    )
    rc, eps = check(parity, tmp_path, "eps", "--steps", "2", "--sluice-override", grpo_eps_1e2)
    assert rc == 1 and not eps["ok"]
    assert eps["advantage_max_abs_diff"] > parity.ADV_TOL and eps["clipped_grad_rel_l2"] > parity.GRAD_TOL
    # AdamW's beta2 0.99 instead of 0.999: the first step moves by lr x sign(g) whatever the betas,
    # so only later steps can tell (10 steps: the weights' change ~3e-3 apart, 30x the tolerance)
    rc, betas = check(
        parity, tmp_path, "betas", "--steps", "10", "--sluice-override", "learner.betas=[0.9, 0.99]"
    )
    assert rc == 1 and not betas["ok"]
    assert betas["advantage_max_abs_diff"] <= parity.ADV_TOL and betas["update_rel_l2"] > parity.UPDATE_TOL
    # from a policy TRL trained part-way (fresh optimisers): the same check, the same verdict
    rc, warm = check(parity, tmp_path, "warm", "--steps", "3", "--from-step", "3")
    assert rc == 0 and warm["ok"] and warm["steps"] == 3
    assert json.loads((tmp_path / "warm" / "trl_parity.json").read_text())["from_step"] == 3


def test_bad_step_counts_are_refused_naming_the_flag(parity, capsys):
    with pytest.raises(SystemExit):
        parity.main(["--steps", "0"])
    assert "--steps: at least 1, not 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parity.main(["--from-step", "-1"])
    assert "--from-step: 0 or more, not -1" in capsys.readouterr().err
