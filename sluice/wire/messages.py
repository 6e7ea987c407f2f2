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


class TrajRef(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """Where a trajectory's arrays lie, for a same-host client (encoded as [segment, offset]):
    in segment file `segment` of the shard's shared directory, the first array at byte `offset`,
    the others right after it in the order of its specs. segment -1: its arrays travel as
    payload frames instead (in order, as without refs)."""

    segment: int  # W: shard. R: client (file <shared_dir>/<segment:012d>.seg)
    offset: int  # W: shard. R: client


class Region(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Space of a segment file reserved for one same-host PUT of one connection."""

    region: int  # W: shard, id the PUT names. R: producer
    segment: int  # W: shard. R: producer (writes <shared_dir>/<segment:012d>.seg)
    offset: int  # W: shard, file offset of the first byte, a multiple of 64. R: producer
    nbytes: int  # W: shard, bytes reserved. R: producer (a PUT may use fewer)


# ---------------------------------------------------------------------------------------------
# Requests (client -> buffer shard). `id` is chosen by the client and echoed in the reply.


class _Request(msgspec.Struct, tag_field="op", forbid_unknown_fields=True):
    proto: int  # W: client, PROTO_VERSION. R: server (refuses other versions)
    id: int  # W: client, request id. R: client (matches replies to requests)


class PutRequest(_Request, tag="PUT"):
    """Store trajectories. Idempotent by traj_id: a resend after a lost reply is harmless."""

    trajs: list[TrajectoryMeta]  # payload frames follow, trajectory by trajectory
    # Same-host producers: the payload is not in frames but in a region reserved with RESERVE
    # and written by the producer (layout: docs/protocol.md). None: payload frames follow.
    region: int | None = None  # W: producer, ReserveReply.region. R: shard
    region_checksum: int = 0  # W: producer, xxh3-64 (seed 0) of the bytes it used. R: shard checks
    reserve_next: int = 0  # W: producer (with a region), bytes to reserve for its next PUT. R: shard


class GetRequest(_Request, tag="GET"):
    """Lease whole groups, oldest first, up to `max_trajs` trajectories (at least one group)."""

    max_trajs: int  # W: learner. R: shard
    min_version: int = 0  # W: learner (its version - max_staleness). R: shard drops older groups
    policy_id: str = "default"  # W: learner. R: shard (which stream)
    wait_ms: int = 0  # W: learner. R: shard, how long to park the request when nothing is ready
    token: str = ""  # W: same-host client, the shard's token. R: shard (match: refs, not frames)
    # W: learner, leases of this shard to ACK first (as ACK would; an unknown one fails the
    # request with UNKNOWN_LEASE, those before it stay ACKed). R: shard
    ack: list[str] = []
    # W: learner, its stable name ("learner/<policy>"). R: shard, tags the lease with it
    holder: str = ""
    # W: learner, new at each start of the holder. R: shard: a new one first requeues the leases
    # (and drops the parked GETs) of the holder's earlier incarnations (docs/protocol.md, GET)
    incarnation: str = ""


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
    token: str = ""  # W: same-host client, the shard's token. R: shard (match: refs, not frames)


class PriorityRequest(_Request, tag="PRIORITY"):
    """Replay shards: new priorities for groups drawn earlier (keys from SampleReply.items)."""

    keys: list[int]  # W: learner, SampledItem.key of each group. R: shard (unknown keys are skipped)
    priorities: list[float]  # W: learner, one per key, finite and >= 0. R: shard


class CancelRequest(_Request, tag="CANCEL"):
    """Ends a parked (long-polling) GET of the same connection early; it is answered at once."""

    target: int  # W: client, the id of its parked GET. R: shard


class StatsRequest(_Request, tag="STATS"):
    pass


class HelloRequest(_Request, tag="HELLO"):
    """Which transports this shard offers this client (the same-host handshake)."""

    host_id: str = ""  # W: client, its kernel's boot id. R: shard (logs)


class ReserveRequest(_Request, tag="RESERVE"):
    """Same-host producers: reserve `nbytes` of the shard's active segment for one PUT."""

    nbytes: int  # W: producer, the region's size (its layout: docs/protocol.md). R: shard
    token: str  # W: producer, read from the shard's token file. R: shard (must match its own)
    release: int = 0  # W: producer, a region of its own it will not use (dropped; nbytes 0: only that)


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
    | HelloRequest
    | ReserveRequest
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
    next_region: Region | None = None  # reserved as `reserve_next` asked (None: not reserved)


class GetReply(_Reply, tag="GET"):
    lease_id: str = ""  # empty when nothing was leased
    trajs: list[TrajectoryMeta] = []  # payload frames follow, trajectory by trajectory
    dropped_stale: int = 0  # trajectories dropped by this GET for being older than min_version
    refs: list[TrajRef] = []  # one per traj when the request's token matched; else empty
    acked: int = 0  # trajectories deleted by the request's `ack` leases


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
    refs: list[TrajRef] = []  # one per traj when the request's token matched; else empty


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


class HelloReply(_Reply, tag="HELLO"):
    host_id: str = ""  # the shard's kernel boot id: a client with another one is remote
    shared_dir: str = ""  # absolute path of the shard's segment files; "" offers ZeroMQ only
    token_file: str = ""  # file in shared_dir holding the token; readable only by the shard's user
    min_put_bytes: int = 0  # PUT messages with less payload should carry frames (not worth a RESERVE)
    reserve_timeout_ms: int = 0  # a reservation unused this long is dropped


class ReserveReply(_Reply, tag="RESERVE"):
    region: int = 0  # id to name in the PUT (valid for this connection, for reserve_timeout_s)
    segment: int = 0  # the region lies in <shared_dir>/<segment:012d>.seg ...
    offset: int = 0  # ... from this byte (a multiple of 64), for the requested nbytes


ErrorCode = Literal[
    "BAD_FRAME",  # the header frame is not a msgpack map
    "BAD_HEADER",  # the header does not match the op's schema
    "BAD_PAYLOAD",  # payload frames missing, extra or of the wrong length
    "PROTO_VERSION",  # header.proto is not a version this server speaks
    "TOO_LARGE",  # the message or batch exceeds a configured limit
    "FULL",  # the shard is at capacity; retry after retry_after_ms
    "UNKNOWN_LEASE",  # ACK/NACK of a lease that expired or never existed
    "SUPERSEDED",  # GET from a holder's incarnation that a newer one replaced
    "WRONG_MODE",  # an op of the other buffer mode (GET/ACK/NACK on replay, SAMPLE/PRIORITY on fifo)
    "UNAVAILABLE",  # the shard cannot write its log; nothing was changed, retry later
    "NOT_SAME_HOST",  # RESERVE without the shard's token (or a shard that offers no shared memory)
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
    | HelloReply
    | ReserveReply
    | ErrorReply
)
