"""Typed headers of the Sluice wire protocol (version 1).

Every message is a ZeroMQ multipart message whose first frame is a msgpack map (the header)
and whose following frames are raw array payloads, described by `ArraySpec`s in the header.
The header's `op` field selects the message type; decoding validates every field strictly
(msgspec), so a bad header becomes an error reply naming the field, never a crash.

Field comments say who writes (W) and who reads (R) each field. `docs/protocol.md` is the
language-neutral description of the same thing.
"""

from __future__ import annotations

from typing import Literal

import msgspec

PROTO_VERSION = 1

Scalar = bool | int | float | str


class ArraySpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Describes one raw payload frame: C-contiguous, little-endian."""

    name: str  # W: producer. R: consumer (key in the trajectory's array dict)
    dtype: str  # W: producer, one of codec.DTYPES. R: codec
    shape: list[int]  # W: producer. R: codec (frame length must equal prod(shape) * itemsize)


class TrajectoryMeta(msgspec.Struct, forbid_unknown_fields=True):
    """Everything about one trajectory except its arrays."""

    traj_id: str  # W: rollout, globally unique. R: buffer (dedupe), learner (logging)
    group_id: str  # W: rollout. R: buffer (shard key; a group is delivered whole)
    version: int  # W: rollout, oldest policy version that produced any token/step. R: buffer, learner
    group_size: int = 1  # W: rollout, trajectories in this group. R: buffer (group completeness)
    policy_id: str = "default"  # W: rollout. R: buffer (per-policy streams), learner groups
    reward: float = 0.0  # W: rollout (task reward). R: learner (advantages), metrics
    arrays: list[ArraySpec] = []  # W: rollout. R: codec; one payload frame per spec, in order
    info: dict[str, Scalar] = {}  # W: rollout/task (free-form scalars). R: metrics


# ---------------------------------------------------------------------------------------------
# Requests (client -> buffer shard). `id` is chosen by the client and echoed in the reply.


class _Request(msgspec.Struct, tag_field="op", forbid_unknown_fields=True):
    proto: int  # W: client, PROTO_VERSION. R: server (refuses other versions)
    id: int  # W: client, request id. R: client (matches replies to requests)


class PutRequest(_Request, tag="PUT"):
    """Store trajectories. Idempotent by traj_id: a resend after a lost reply is harmless."""

    trajs: list[TrajectoryMeta]  # payload frames follow, trajectory by trajectory


class GetRequest(_Request, tag="GET"):
    """Lease whole groups, oldest first, up to `max_trajs` trajectories (at least one group)."""

    max_trajs: int  # W: learner. R: shard
    min_version: int = 0  # W: learner (its version - max_staleness). R: shard drops older groups
    policy_id: str = "default"  # W: learner. R: shard (which stream)
    wait_ms: int = 0  # W: learner. R: shard, how long to park the request when nothing is ready


class AckRequest(_Request, tag="ACK"):
    """The leased samples were used: delete them."""

    lease_id: str


class NackRequest(_Request, tag="NACK"):
    """The leased samples were not used: return them to the front of the queue."""

    lease_id: str


class SampleRequest(_Request, tag="SAMPLE"):
    """Replay shards: draw `n` groups with replacement (uniform or by priority). No lease."""

    n: int  # W: learner, groups to draw (0: only report count and total_priority). R: shard
    min_version: int = 0  # W: learner. R: shard drops (and counts) older groups before drawing
    policy_id: str = "default"  # W: learner. R: shard (which stream)
    beta: float = 0.4  # W: learner, importance-weight exponent (PER's beta). R: shard (weights)
    seed: int | None = None  # W: learner, for reproducible draws (tests). R: shard's sampler


class PriorityRequest(_Request, tag="PRIORITY"):
    """Replay shards: new priorities for groups drawn earlier (keys from SampleReply.items)."""

    keys: list[int]  # W: learner, SampledItem.key of each group. R: shard (unknown keys are skipped)
    priorities: list[float]  # W: learner, one per key, finite and >= 0. R: shard


class CancelRequest(_Request, tag="CANCEL"):
    """Ends a parked (long-polling) GET of the same connection early; it is answered at once."""

    target: int  # W: client, the id of its parked GET. R: shard


class StatsRequest(_Request, tag="STATS"):
    pass


class PingRequest(_Request, tag="PING"):
    pass


Request = (
    PutRequest
    | GetRequest
    | AckRequest
    | NackRequest
    | SampleRequest
    | PriorityRequest
    | CancelRequest
    | StatsRequest
    | PingRequest
)


# ---------------------------------------------------------------------------------------------
# Replies (buffer shard -> client). Every reply carries `ok`.


class _Reply(msgspec.Struct, tag_field="op", forbid_unknown_fields=True):
    proto: int
    id: int  # echo of the request id (-1 when the request was too broken to read one)
    ok: bool = True


class PutReply(_Reply, tag="PUT"):
    accepted: int = 0  # new trajectories stored
    duplicates: int = 0  # trajectories whose traj_id was already seen (dropped)


class GetReply(_Reply, tag="GET"):
    lease_id: str = ""  # empty when nothing was leased
    trajs: list[TrajectoryMeta] = []  # payload frames follow, trajectory by trajectory
    dropped_stale: int = 0  # trajectories dropped by this GET for being older than min_version


class AckReply(_Reply, tag="ACK"):
    count: int = 0  # trajectories deleted
    replayed: bool = False  # the lease had been ACKed before (e.g. a resend after a lost reply)


class NackReply(_Reply, tag="NACK"):
    count: int = 0  # trajectories requeued


class SampledItem(msgspec.Struct, forbid_unknown_fields=True):
    """One drawn group of a SampleReply; its trajectories follow in `trajs`, in order."""

    key: int  # W: shard, the group's key for PRIORITY updates. R: learner
    size: int  # W: shard, trajectories of this group in `trajs`. R: client (splits `trajs`)
    prob: float  # W: shard, probability of drawing this group from this shard. R: client (weights)
    weight: float  # W: shard, (count * prob)^-beta / max over the reply. R: learner (loss weights)


class SampleReply(_Reply, tag="SAMPLE"):
    items: list[SampledItem] = []  # one per draw (a group drawn twice appears twice)
    trajs: list[TrajectoryMeta] = []  # the trajectories of every item, in order; payload follows
    count: int = 0  # groups eligible for drawing (after dropping stale ones)
    total_priority: float = 0.0  # sum of their sampling priorities (the normaliser of `prob`)
    dropped_stale: int = 0  # trajectories dropped by this SAMPLE for being older than min_version


class PriorityReply(_Reply, tag="PRIORITY"):
    updated: int = 0  # keys whose priority was set
    unknown: int = 0  # keys no longer stored (evicted or dropped): skipped


class CancelReply(_Reply, tag="CANCEL"):
    cancelled: bool = False  # False: the target had been answered already (or never parked)


class StatsReply(_Reply, tag="STATS"):
    stats: dict[str, int] = {}  # counters and gauges, see docs/protocol.md
    versions: dict[str, int] = {}  # queued trajectories per policy version (keys are str(int))


class PingReply(_Reply, tag="PING"):
    pass


ErrorCode = Literal[
    "BAD_FRAME",  # the header frame is not a msgpack map
    "BAD_HEADER",  # the header does not match the op's schema
    "BAD_PAYLOAD",  # payload frames missing, extra or of the wrong length
    "PROTO_VERSION",  # header.proto is not a version this server speaks
    "TOO_LARGE",  # the message or batch exceeds a configured limit
    "FULL",  # the shard is at capacity; retry after retry_after_ms
    "UNKNOWN_LEASE",  # ACK/NACK of a lease that expired or never existed
    "WRONG_MODE",  # an op of the other buffer mode (GET/ACK/NACK on replay, SAMPLE/PRIORITY on fifo)
    "UNAVAILABLE",  # the shard cannot write its log; nothing was changed, retry later
    "INTERNAL",  # a bug in the server; it keeps serving
]


class ErrorReply(_Reply, tag="ERROR"):
    ok: bool = False
    code: str = "INTERNAL"  # one of ErrorCode
    message: str = ""  # names the bad field or frame
    retry_after_ms: int = 0  # set with FULL


Reply = (
    PutReply
    | GetReply
    | AckReply
    | NackReply
    | SampleReply
    | PriorityReply
    | CancelReply
    | StatsReply
    | PingReply
    | ErrorReply
)
