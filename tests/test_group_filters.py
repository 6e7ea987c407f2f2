"""The rollout half of a workflow (rollout_svc/filters.py): DAPO's zero-variance filter, its
guard against starving the learner once every group scores the same, and a user's filter."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from sluice.config.workflow import DropZeroVariance, UserGroupFilter
from sluice.plugins import UserCodeError
from sluice.rollout_svc.episodes import Sample
from sluice.rollout_svc.filters import ZeroVarianceFilter, build_filters


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
