"""Trajectories as one byte string, for rank 0 to scatter a batch over its learner group.

Layout: 8 bytes little-endian header length, the msgpack list of TrajectoryMeta (the wire
protocol's own schema), then every array's bytes in the order the metas list them. No pickle.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import msgspec

from sluice.trajectory import Trajectory, from_wire_batch, to_wire_batch
from sluice.wire.codec import DTYPES
from sluice.wire.messages import TrajectoryMeta

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[TrajectoryMeta])


def pack(trajs: Sequence[Trajectory]) -> bytes:
    metas, frames = to_wire_batch(trajs)
    header = _encoder.encode(metas)
    return b"".join([struct.pack("<Q", len(header)), header, *[bytes(f) for f in frames]])


def unpack(data: bytes) -> list[Trajectory]:
    if not data:
        return []
    (n,) = struct.unpack_from("<Q", data)
    metas = _decoder.decode(data[8 : 8 + n])
    view = memoryview(data)
    frames, offset = [], 8 + n
    for meta in metas:
        for spec in meta.arrays:
            size = math.prod(spec.shape) * DTYPES[spec.dtype]
            frames.append(view[offset : offset + size])
            offset += size
    if offset != len(data):
        raise ValueError(f"batch transfer: {len(data) - offset} trailing bytes")
    return from_wire_batch(metas, frames)
