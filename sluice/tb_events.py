"""TensorBoard event files, framed with a native CRC-32C.

tensorboard's own writer (which torch's `SummaryWriter` wraps) frames every record with a
CRC-32C computed in pure Python, ~0.2 ms per KiB, in a thread that holds the GIL beside the
training thread: a vs_trl learner step was ~6% slower with TensorBoard on than off. This
writer frames records the same way (TFRecord: length, masked CRC of the length, data, masked
CRC of the data) with google-crc32c, Google's C implementation, and the protos tensorboard
ships; TensorBoard reads the files as its own. docs/architecture.md ("Observability", and
"Cores and threads" for the measurement) has the rest.
"""

from __future__ import annotations

import os
import socket
import struct
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

import google_crc32c
from tensorboard.compat.proto.event_pb2 import Event, SessionLog  # pyright: ignore[reportAttributeAccessIssue]
from tensorboard.compat.proto.summary_pb2 import Summary  # pyright: ignore[reportAttributeAccessIssue]

FLUSH_EVERY_S = 1.0  # TensorBoard shows a live run at most this far behind


def masked_crc(data: bytes) -> bytes:
    """TFRecord's masked CRC-32C, little-endian."""
    crc = google_crc32c.value(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


class EventWriter:
    """One event file in `log_dir`. `purge_step`: a resumed run's first step; TensorBoard drops
    the events at or after it that an earlier writer left (steps the run does again). Used from
    one thread at a time."""

    def __init__(self, log_dir: Path, purge_step: int | None = None) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        # TensorBoard reads a directory's files in name order: seconds, then nanoseconds (a
        # resumed writer's file sorts after the one it purges, also within the same second)
        now = time.time_ns()
        stamp = f"{now // 10**9}.{now % 10**9:09d}"
        suffix = f"{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        self.path = log_dir / f"events.out.tfevents.{stamp}.{suffix}"
        self._file = self.path.open("ab")
        self._flushed = time.monotonic()
        self.add_event(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:
            start = SessionLog(status=SessionLog.START)
            self.add_event(Event(wall_time=time.time(), step=purge_step, session_log=start))
        self.flush()

    def add_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        """Every scalar of one step in one event (one record, one CRC pair)."""
        values = [Summary.Value(tag=tag, simple_value=float(v)) for tag, v in scalars.items()]
        self.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))

    def add_event(self, event: Event) -> None:
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        self._file.write(header + masked_crc(header) + data + masked_crc(data))
        if time.monotonic() - self._flushed >= FLUSH_EVERY_S:
            self.flush()

    def flush(self) -> None:
        self._file.flush()
        self._flushed = time.monotonic()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
