"""sluice/tb_events.py: event files TensorBoard reads as its own (CRC checked), and a resumed
writer's purge step."""

from __future__ import annotations

import os

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

from sluice.tb_events import EventWriter, masked_crc


@pytest.mark.parametrize("size", [0, 1, 8, 1000, 4099])
def test_the_crc_is_tensorboards(size):
    data = os.urandom(size)
    assert masked_crc(data) == masked_crc32c(data).to_bytes(4, "little")


def scalars(log_dir, tag):
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_reads_every_step(tmp_path):
    writer = EventWriter(tmp_path)
    for step in range(1, 4):
        writer.add_scalars({"learner/loss": 0.5 * step, "staleness/lag_0": 64}, step)
    writer.close()
    assert scalars(tmp_path, "learner/loss") == [(1, 0.5), (2, 1.0), (3, 1.5)]
    assert scalars(tmp_path, "staleness/lag_0") == [(s, 64.0) for s in (1, 2, 3)]


def test_a_resumed_writer_purges_the_steps_it_does_again(tmp_path):
    first = EventWriter(tmp_path)
    for step in range(1, 6):
        first.add_scalars({"learner/loss": float(step)}, step)
    first.close()
    # checkpoint at step 2: steps 3.. run again (a new file, within the same second here)
    resumed = EventWriter(tmp_path, purge_step=3)
    assert sorted(tmp_path.iterdir()) == [first.path, resumed.path]
    for step in (3, 4):
        resumed.add_scalars({"learner/loss": 10.0 * step}, step)
    resumed.close()
    assert scalars(tmp_path, "learner/loss") == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_a_corrupt_record_is_detected_by_tensorboard(tmp_path):
    writer = EventWriter(tmp_path)
    writer.add_scalars({"learner/loss": 1.0}, 1)
    writer.close()
    raw = bytearray(writer.path.read_bytes())
    raw[-6] ^= 0xFF  # a byte of the last record's data: its CRC no longer matches
    writer.path.write_bytes(bytes(raw))
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert "learner/loss" not in acc.Tags()["scalars"]
