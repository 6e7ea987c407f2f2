"""Control-plane messages (same framing as the buffer protocol: a msgpack header, no payload).

Served by learner rank 0 on `control.endpoint`; rollout services and `sluice status` connect.
"""

from __future__ import annotations

import msgspec

from sluice.wire.messages import ErrorReply


class _Request(msgspec.Struct, tag_field="op", forbid_unknown_fields=True):
    proto: int
    id: int


class AdmitRequest(_Request, tag="ADMIT"):
    """A rollout service asks to start `n` samples (whole groups of `group_size`)."""

    service_id: str  # W: rollout. R: learner (per-service accounting)
    n: int  # W: rollout, samples it wants to start now
    group_size: int = 1  # W: rollout; grants are whole groups


class RefundRequest(_Request, tag="REFUND"):
    """Samples admitted but never delivered (aborted, filtered out) give their quota back."""

    service_id: str
    n: int


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


ControlRequest = AdmitRequest | RefundRequest | HeartbeatRequest | StatusRequest


class _Reply(msgspec.Struct, tag_field="op", forbid_unknown_fields=True):
    proto: int
    id: int
    ok: bool = True


class AdmitReply(_Reply, tag="ADMIT"):
    granted: int = 0  # samples the service may start now (a multiple of group_size, may be 0)
    version: int = 0  # learner version when granting
    weights_version: int = 0  # newest published weights: admitted work must use weights >= this
    retry_after_ms: int = 0  # when granted < n: ask again after this long


class RefundReply(_Reply, tag="REFUND"):
    pass


class HeartbeatReply(_Reply, tag="HEARTBEAT"):
    version: int = 0  # learner version
    weights_version: int = 0  # newest published weights (the sim engine's only "weights")


class ServiceStatus(msgspec.Struct):
    role: str
    age_s: float  # seconds since the last heartbeat
    stats: dict[str, float]


class StatusReply(_Reply, tag="STATUS"):
    learner: dict[str, float] = {}
    services: dict[str, ServiceStatus] = {}
    admission: dict[str, float] = {}


ControlReply = AdmitReply | RefundReply | HeartbeatReply | StatusReply | ErrorReply

request_decoder = msgspec.msgpack.Decoder(ControlRequest)
reply_decoder = msgspec.msgpack.Decoder(ControlReply)
