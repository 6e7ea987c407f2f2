"""The rollout half of a workflow (rollout_svc/filters.py): DAPO's zero-variance filter, its
guard against starving the learner once every group scores the same, and a user's filter."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from sluice.config.workflow import DropZeroVariance, UserGroupFilter
from sluice.plugins import UserCodeError
from sluice.rollout_svc.episodes import Sample
from sluice.rollout_svc.filters import Oversampler, ZeroVarianceFilter, build_filters, oversampler


def group(*rewards: float) -> list[Sample]:
    ids = np.zeros(2, np.int32)
    return [Sample(ids, np.zeros(2, np.float32), ids, None, True, r, {}, 0) for r in rewards]


def test_groups_whose_rewards_differ_are_kept_and_equal_ones_dropped():
    keep = ZeroVarianceFilter(spread=0.1, keep_after=None)
    assert keep(group(0.0, 1.0)) and keep(group(0.5)) and keep(group(0.75, 0.9))
    assert not keep(group(0.75, 0.75)) and not keep(group(0.75, 0.8))  # within the spread
    assert not any(keep(group(1.0, 1.0)) for _ in range(10_000)) and keep.passed == 0  # null: never


def test_after_keep_after_drops_in_a_row_the_next_equal_group_is_kept(caplog):
    keep = ZeroVarianceFilter(spread=0.0, keep_after=3, service_id="rollout-7")
    with caplog.at_level(logging.WARNING, logger="sluice.rollout_svc.filters"):
        verdicts = [keep(group(1.0, 1.0)) for _ in range(8)]
    assert verdicts == [False, False, False, True, False, False, False, True]
    assert keep.passed == 2
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "rollout-7" in warned[0] and "3 groups in a row" in warned[0]


def test_a_group_with_signal_starts_the_count_again():
    keep = ZeroVarianceFilter(spread=0.0, keep_after=2)
    assert [keep(group(1.0, 1.0)), keep(group(1.0, 1.0)), keep(group(0.0, 1.0))] == [False, False, True]
    assert [keep(group(1.0, 1.0)), keep(group(1.0, 1.0)), keep(group(1.0, 1.0))] == [False, False, True]


def test_build_filters_follows_the_workflow(tmp_path):
    (tmp_path / "f.py").write_text("def odd(samples, params):\n    return len(samples) % 2 == 1\n")
    stages = [DropZeroVariance(keep_after=5), UserGroupFilter(stage=f"{tmp_path}/f.py:odd")]
    dapo, user = build_filters(stages, "rollout-0")
    assert isinstance(dapo, ZeroVarianceFilter) and (dapo.keep_after, dapo.service_id) == (5, "rollout-0")
    assert user(group(0.0)) and not user(group(0.0, 1.0))
    assert DropZeroVariance().keep_after == 256
    with pytest.raises(ValueError, match="keep_after"):
        DropZeroVariance(keep_after=0)


def test_a_user_filter_that_raises_names_its_stage(tmp_path):
    (tmp_path / "f.py").write_text("def bad(samples, params):\n    raise KeyError('x')\n")
    (user,) = build_filters([UserGroupFilter(stage=f"{tmp_path}/f.py:bad")])
    with pytest.raises(UserCodeError, match=r"workflow.rollout\[0\].stage: the filter raised KeyError"):
        user(group(0.0, 1.0))


def test_the_oversampler_generates_the_grant_over_the_share_kept_within_its_limit():
    over = Oversampler(most=2.0, weight=0.5)
    assert over.prompts(8) == 8  # nothing dropped yet: the grant
    over.observe(live=8, kept=6)  # the first batch's share outright: 0.75
    assert over.keep_rate == pytest.approx(0.75) and over.prompts(8) == round(8 / 0.75) + 1 == 12
    over.observe(live=8, kept=0)  # then half way: 0.375, and 8 / 0.375 + 1 = 22 is over twice 8
    assert over.prompts(8) == 16 and over.prompts(1) == 2 and over.prompts(0) == 0
    over.observe(live=0, kept=0)  # every group skipped (reward failures): no evidence either way
    assert over.keep_rate == pytest.approx(0.375)
    for _ in range(40):
        over.observe(live=8, kept=8)
    assert over.prompts(8) <= 9  # back near the grant once groups are kept again
    assert Oversampler(most=1.0).prompts(8) == 8
    none_kept = Oversampler(most=2.0)
    none_kept.observe(live=2, kept=0)  # a solved task: every group dropped
    assert none_kept.keep_rate == 0.0 and none_kept.prompts(2) == 4 and none_kept.prompts(0) == 0


def test_oversampling_is_dapos_setting_and_off_without_its_filter():
    assert oversampler([DropZeroVariance()]).most == 2.0 == DropZeroVariance().oversample
    assert oversampler([DropZeroVariance(oversample=3.0)]).most == 3.0
    assert oversampler([UserGroupFilter(stage="pkg.mod:fn")]).most == 1.0 and oversampler([]).most == 1.0
    with pytest.raises(ValueError, match="oversample"):
        DropZeroVariance(oversample=0.5)
