"""Whole trajectory groups for tests, built one way: `make_group` (one array of chosen bytes, for
buffer tests) and `group_of` (the arrays a test made itself, e.g. an LLM sample's)."""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from sluice.trajectory import Trajectory


def byte_of(gid: str) -> int:
    """A byte value (0-250) that is a function of a group id, the same in every process and run
    (CRC-32, not `hash`, whose per-process salt changed it from run to run)."""
    return zlib.crc32(gid.encode()) % 251


def make_group(
    gid: str,
    size: int = 2,
    version: int = 0,
    nbytes: int = 16,
    *,
    dtype: npt.DTypeLike = np.int32,
    fill: int | None = None,
    ramp: bool = False,
    extra: Mapping[str, np.ndarray] | None = None,
) -> list[Trajectory]:
    """`size` trajectories `gid/0` .. `gid/<size-1>` of group `gid`, reward j for the j-th.

    Each holds one array `x` of `nbytes` bytes of `dtype`, every element `fill` (default: the
    trajectory's index j); with `ramp`, x = fill, fill+1, ... (wrapping in `dtype`), so a test
    sees bytes moved or reordered. `extra` arrays are added to every trajectory as given."""
    dt = np.dtype(dtype)
    count = nbytes // dt.itemsize
    arrays = []
    for j in range(size):
        start = j if fill is None else fill
        x = (np.arange(count) + start) if ramp else np.full(count, start)
        arrays.append({"x": x.astype(dt), **(extra or {})})
    return group_of(gid, arrays, version)


def group_of(
    gid: str,
    arrays: list[dict[str, np.ndarray]],
    version: int = 0,
    *,
    rewards: Sequence[float] | None = None,
    info: bool = False,
) -> list[Trajectory]:
    """The group `gid` of one trajectory per entry of `arrays`: `gid/j`, reward `rewards[j]`
    (default j) and, with `info`, info {"j": j}."""
    return [
        Trajectory(
            traj_id=f"{gid}/{j}",
            group_id=gid,
            version=version,
            group_size=len(arrays),
            reward=float(j if rewards is None else rewards[j]),
            info={"j": j} if info else {},
            arrays=a,
        )
        for j, a in enumerate(arrays)
    ]
