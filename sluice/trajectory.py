"""The unit of experience: named arrays plus metadata.

LLM trajectories carry `prompt_ids`, `completion_ids`, `behaviour_logprobs` (one per
completion token) and `token_versions` (the policy version that sampled each completion
token). Classic-RL trajectories carry `obs`, `actions`, `rewards`, `dones`, `behaviour_logits`
and so on. The wire format does not care which: it is arrays plus `TrajectoryMeta`.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from sluice.wire import codec
from sluice.wire.messages import Scalar, TrajectoryMeta


@dataclass
class Trajectory:
    traj_id: str  # globally unique; the buffer drops a second PUT of the same id
    group_id: str  # trajectories sampled for the same prompt/episode batch; never split
    version: int  # oldest policy version that produced any token or step of this trajectory
    arrays: dict[str, np.ndarray]
    group_size: int = 1
    policy_id: str = "default"
    reward: float = 0.0
    info: dict[str, Scalar] = field(default_factory=dict)

    @staticmethod
    def new_id() -> str:
        return uuid.uuid4().hex

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def to_wire(self) -> tuple[TrajectoryMeta, list[memoryview]]:
        names = list(self.arrays)
        meta = TrajectoryMeta(
            traj_id=self.traj_id,
            group_id=self.group_id,
            version=int(self.version),
            group_size=int(self.group_size),
            policy_id=self.policy_id,
            reward=float(self.reward),
            arrays=[codec.array_spec(n, self.arrays[n]) for n in names],
            info=dict(self.info),
        )
        return meta, [codec.array_payload(self.arrays[n]) for n in names]

    @classmethod
    def from_wire(cls, meta: TrajectoryMeta, frames: Sequence[codec.Frame]) -> Trajectory:
        arrays = {spec.name: codec.view_array(spec, f) for spec, f in zip(meta.arrays, frames)}
        return cls.from_meta(meta, arrays)

    @classmethod
    def from_meta(cls, meta: TrajectoryMeta, arrays: dict[str, np.ndarray]) -> Trajectory:
        """The trajectory `meta` describes, holding `arrays` (views of frames or of mapped files)."""
        return cls(
            traj_id=meta.traj_id,
            group_id=meta.group_id,
            version=meta.version,
            arrays=arrays,
            group_size=meta.group_size,
            policy_id=meta.policy_id,
            reward=meta.reward,
            info=dict(meta.info),
        )


def to_wire_batch(trajs: Sequence[Trajectory]) -> tuple[list[TrajectoryMeta], list[memoryview]]:
    metas, frames = [], []
    for t in trajs:
        m, f = t.to_wire()
        metas.append(m)
        frames.extend(f)
    return metas, frames


def from_wire_batch(metas: Sequence[TrajectoryMeta], payload: Sequence[codec.Frame]) -> list[Trajectory]:
    per_traj = codec.split_payload(metas, payload)
    return [Trajectory.from_wire(m, f) for m, f in zip(metas, per_traj)]
