"""The learner's metrics writer: JSONL lines and TensorBoard scalars (learner/metrics.py)."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from sluice.config.loader import load_config
from sluice.learner.metrics import LearnerMetrics
from sluice.metrics import read_jsonl

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


def test_every_scalar_of_a_step_reaches_tensorboard_and_the_log(tmp_path):
    cfg = load_config(QUICKSTART, [f"run.dir={tmp_path}"])
    (tmp_path / "metrics").mkdir()
    metrics = LearnerMetrics(cfg, "default", rank=0, resumed_at=None)
    for version in (1, 2):
        metrics.step(
            version, {"loss": 0.5 * version, "reward_mean": 0.1, "staleness_hist": [60, 4], "note": "x"}
        )
    metrics.close()
    assert [r["loss"] for r in read_jsonl(tmp_path / "metrics" / "learner.jsonl")] == [0.5, 1.0]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"learner/loss", "learner/reward_mean", "staleness/lag_0", "staleness/lag_1"} <= tags
    assert "learner/note" not in tags and "learner/version" not in tags
    assert [(e.step, e.value) for e in events.Scalars("learner/loss")] == [(1, 0.5), (2, 1.0)]
    assert [e.value for e in events.Scalars("staleness/lag_1")] == [4.0, 4.0]


def test_steps_queued_between_wake_ups_are_written_together_and_flush_wakes_the_writer(tmp_path, monkeypatch):
    """The writer wakes every WRITE_EVERY_S, not once a step (each wake-up took the GIL from
    the training thread); a checkpoint's flush must not wait for the next wake-up."""
    monkeypatch.setattr("sluice.learner.metrics.WRITE_EVERY_S", 3600.0)
    cfg = load_config(QUICKSTART, [f"run.dir={tmp_path}"])
    (tmp_path / "metrics").mkdir()
    metrics = LearnerMetrics(cfg, "default", rank=0, resumed_at=None)
    assert metrics.log is not None
    writes: list[int] = []
    write_many = metrics.log.write_many
    monkeypatch.setattr(
        metrics.log, "write_many", lambda records: (writes.append(len(records)), write_many(records))
    )
    try:
        for version in (1, 2, 3):
            metrics.step(version, {"loss": float(version)})
        metrics.flush()  # an hour before the writer's next wake-up of its own
        assert [r["loss"] for r in read_jsonl(tmp_path / "metrics" / "learner.jsonl")] == [1.0, 2.0, 3.0]
        assert writes == [3]
        metrics.step(4, {"loss": 4.0})
    finally:
        metrics.close()  # wakes it too: the last step is written before the files close
    assert [r["loss"] for r in read_jsonl(tmp_path / "metrics" / "learner.jsonl")][-1] == 4.0
    assert writes == [3, 1]
