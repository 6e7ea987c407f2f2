"""Control-plane messages (same framing as the buffer protocol: a msgpack header, no payload).

Served by learner rank 0 on `control.endpoint`; rollout services and `sluice status` connect.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from sluice.wire.messages import ErrorReply

SyncOutcome = Literal["ok", "refused", "failed"]


class _Request(msgspec.Struct, tag_field="op", forbid_unknown_fields=True):
    proto: int
    id: int


class AdmitRequest(_Request, tag="ADMIT"):
    """A rollout service asks to start `n` samples (whole groups of `group_size`)."""

    service_id: str  # W: rollout. R: learner (per-service accounting)
    n: int  # W: rollout, samples it wants to start now
    group_size: int = 1  # W: rollout; grants are whole groups
    # W: rollout. R: server: with nothing to grant, hold the request up to this long and answer
    # as soon as quota frees up (a publish, a release, a refund); 0 answers at once.
    wait_ms: int = 0
    # W: rollout, its own count of ADMITs (1, 2, ...) kept when it re-sends one that was not
    # answered in time. R: server: a repeat of the last answered seq gets the same answer again
    # (nothing is granted twice); 0: not retried, never deduplicated.
    seq: int = 0
    # W: rollout, samples it has PUT so far (as in HEARTBEAT; -1: not said). R: server, the
    # count a service that dies is credited with (the newest of its ADMITs and heartbeats)
    delivered: int = -1
    # W: rollout, the weight-sync service id its receiver JOINed as ("": none, e.g. sim). R:
    # server: the grant may follow the newest version that member reported verified, before
    # every member has (the published version); weights_version in the reply says which
    member: str = ""


class RefundRequest(_Request, tag="REFUND"):
    """Samples admitted but never delivered (aborted, filtered out) give their quota back."""

    service_id: str
    n: int
    seq: int = 0  # as for ADMIT (the two share one count per service): a re-sent REFUND counts once


class HeartbeatRequest(_Request, tag="HEARTBEAT"):
    """Liveness and live numbers of a role, shown by `sluice status`. A rollout that stays
    silent for `control.service_timeout_s` is gone: its admitted samples that it did not
    deliver go back to the quota."""

    service_id: str  # W: the role (rollout-0.<incarnation>, ...). R: learner
    role: str = "rollout"
    stats: dict[str, float] = {}  # W: the role, free-form gauges (version, samples_per_s, ...)
    delivered: int = -1  # W: rollout, samples it PUT so far (this incarnation); -1: not a producer


class StatusRequest(_Request, tag="STATUS"):
    pass


# -- weight-sync membership (served when the learner attached its membership registry) ---------


class JoinRequest(_Request, tag="JOIN"):
    """A rollout service's weight receiver asks to be in the broadcast group. It is included at
    the learner's next membership epoch (the next publish)."""

    service_id: str  # W: receiver (rollout-0, ...). R: learner; a member is known by it
    incarnation: str  # W: receiver, unique per process. R: learner; a new one replaces the old
    held_version: int = -1  # W: receiver, version it holds (pulled or kept). -1: none
    # W: receiver, the device type its weights land on (cpu, cuda, npu). R: learner, which
    # picks each epoch's backend from its members' devices (gloo unless all share one accelerator)
    device: str = "cpu"
    # W: receiver, its process id (0: not said). R: learner, so that a launcher that saw that
    # process die can take it out of the group (LEAVE by pid) before its heartbeat stops
    pid: int = 0


class LeaveRequest(_Request, tag="LEAVE"):
    """A receiver that stops leaves the group; the group is rebuilt without it. A launcher
    that saw a rollout process die sends it on the process's behalf, by pid."""

    service_id: str
    # W: receiver. R: learner; a stale incarnation's LEAVE removes nothing
    incarnation: str = ""
    # W: launcher, instead of `incarnation`: the process it saw die. R: learner; removes the
    # member only if its JOIN named this pid (its replacement, a new process, stays)
    pid: int = 0


class SyncReportRequest(_Request, tag="SYNC_REPORT"):
    """What a receiver did with one version: the learner counts refusals and failures and
    rebuilds the group when a member's collective failed."""

    service_id: str
    incarnation: str
    epoch: int  # W: receiver, the epoch the version came over (0 for a ZeroMQ pull)
    version: int  # W: receiver, the version it concerns
    outcome: SyncOutcome  # W: receiver. ok | refused (checksum, layout, delta base) | failed (collective)
    error: str = ""  # W: receiver, why (empty when ok)


ControlRequest = (
    AdmitRequest
    | RefundRequest
    | HeartbeatRequest
    | StatusRequest
    | JoinRequest
    | LeaveRequest
    | SyncReportRequest
)


class _Reply(msgspec.Struct, tag_field="op", forbid_unknown_fields=True):
    proto: int
    id: int
    ok: bool = True


class AdmitReply(_Reply, tag="ADMIT"):
    granted: int = 0  # samples the service may start now (a multiple of group_size, may be 0)
    version: int = 0  # learner version when granting
    weights_version: int = 0  # newest published weights: admitted work must use weights >= this
    retry_after_ms: int = 0  # when granted < n: ask again after this long
    # W: server: weights_version was announced to the asking member, which has not reported it
    # verified yet. R: rollout: take those weights (wait for them) before generating the grant
    ahead: bool = False


class RefundReply(_Reply, tag="REFUND"):
    pass


class HeartbeatReply(_Reply, tag="HEARTBEAT"):
    version: int = 0  # learner version
    weights_version: int = 0  # newest published weights (the sim engine's only "weights")


class ServiceStatus(msgspec.Struct):
    role: str
    age_s: float  # seconds since the last heartbeat
    stats: dict[str, float]


class MemberSyncStatus(msgspec.Struct):
    state: str  # pending (waits for an epoch) | member (in the current group)
    version: int  # last version it reported verified (-1: none yet)
    refused: int  # versions it refused (checksum, layout or delta base mismatch)
    failed: int  # collectives that failed on its side
    last_error: str


class WeightSyncStatus(msgspec.Struct):
    epoch: int  # current membership epoch (0: no group formed yet)
    published_version: int  # newest version published (-1: none)
    members: dict[str, MemberSyncStatus] = {}  # by service id
    counters: dict[str, float] = {}  # publishes, epochs, failures, refused, pulls, ...


class StatusReply(_Reply, tag="STATUS"):
    learner: dict[str, float] = {}
    services: dict[str, ServiceStatus] = {}
    # admission counters (started, quota, refused_asks, released_gone), membership
    # (services_gone) and the server's load (requests received, serve_s: seconds serving them)
    admission: dict[str, float] = {}
    weight_sync: WeightSyncStatus | None = None  # None when the learner serves no membership


class JoinReply(_Reply, tag="JOIN"):
    seq: int = 0  # first store announcement (ws/ann/<seq>) the receiver must read
    epoch: int = 0  # current membership epoch
    published_version: int = -1  # newest version published (-1: none yet)
    # newest version announced: above published_version while its send is in flight, to the
    # epoch formed before this JOIN (the receiver pulls it once published)
    announced_version: int = -1
    # the learner announced its shutdown before this JOIN: nothing more will be sent, and the
    # receiver was not registered (it ends as if it had read the announcement)
    shutting_down: bool = False


class LeaveReply(_Reply, tag="LEAVE"):
    removed: bool = False  # False: not a member (or a stale incarnation)


class SyncReportReply(_Reply, tag="SYNC_REPORT"):
    pass


ControlReply = (
    AdmitReply
    | RefundReply
    | HeartbeatReply
    | StatusReply
    | JoinReply
    | LeaveReply
    | SyncReportReply
    | ErrorReply
)

request_decoder = msgspec.msgpack.Decoder(ControlRequest)
reply_decoder = msgspec.msgpack.Decoder(ControlReply)
