"""Client of the control server (rollout services, `sluice status`). Not thread-safe."""

from __future__ import annotations

import zmq

from sluice.control.messages import (
    AdmitReply,
    AdmitRequest,
    HeartbeatReply,
    HeartbeatRequest,
    JoinReply,
    JoinRequest,
    LeaveReply,
    LeaveRequest,
    RefundRequest,
    StatusReply,
    StatusRequest,
    SyncOutcome,
    SyncReportRequest,
    reply_decoder,
)
from sluice.rpc import RpcConnection
from sluice.wire.messages import PROTO_VERSION


class ControlClient:
    def __init__(self, endpoint: str, *, timeout_s: float = 10.0, ctx: zmq.Context | None = None) -> None:
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.conn = RpcConnection(self.ctx, endpoint, name="control", reply_decoder=reply_decoder)
        self.timeout_s = timeout_s

    def admit(self, service_id: str, n: int, group_size: int, wait_ms: int = 0) -> AdmitReply:
        """`wait_ms` > 0 long-polls: the reply comes when quota frees up or after wait_ms."""
        req = AdmitRequest(
            proto=PROTO_VERSION, id=self.conn.next_id(), service_id=service_id, n=n,
            group_size=group_size, wait_ms=wait_ms,
        )  # fmt: skip
        return self.conn.request(req, timeout_s=self.timeout_s + wait_ms / 1000)[0]

    def refund(self, service_id: str, n: int) -> None:
        req = RefundRequest(proto=PROTO_VERSION, id=self.conn.next_id(), service_id=service_id, n=n)
        self.conn.request(req, timeout_s=self.timeout_s)

    def heartbeat(
        self, service_id: str, role: str, stats: dict[str, float], delivered: int = -1
    ) -> HeartbeatReply:
        req = HeartbeatRequest(
            proto=PROTO_VERSION,
            id=self.conn.next_id(),
            service_id=service_id,
            role=role,
            stats=stats,
            delivered=delivered,
        )
        return self.conn.request(req, timeout_s=self.timeout_s)[0]

    def status(self) -> StatusReply:
        return self.conn.request(
            StatusRequest(proto=PROTO_VERSION, id=self.conn.next_id()), timeout_s=self.timeout_s
        )[0]

    # -- weight-sync membership ------------------------------------------------------------------

    def join(self, service_id: str, incarnation: str, held_version: int, device: str = "cpu") -> JoinReply:
        req = JoinRequest(
            proto=PROTO_VERSION,
            id=self.conn.next_id(),
            service_id=service_id,
            incarnation=incarnation,
            held_version=held_version,
            device=device,
        )
        return self.conn.request(req, timeout_s=self.timeout_s)[0]

    def leave(self, service_id: str, incarnation: str) -> LeaveReply:
        req = LeaveRequest(
            proto=PROTO_VERSION, id=self.conn.next_id(), service_id=service_id, incarnation=incarnation
        )
        return self.conn.request(req, timeout_s=self.timeout_s)[0]

    def sync_report(
        self,
        service_id: str,
        incarnation: str,
        *,
        epoch: int,
        version: int,
        outcome: SyncOutcome,
        error: str = "",
    ) -> None:
        req = SyncReportRequest(
            proto=PROTO_VERSION,
            id=self.conn.next_id(),
            service_id=service_id,
            incarnation=incarnation,
            epoch=epoch,
            version=version,
            outcome=outcome,
            error=error,
        )
        self.conn.request(req, timeout_s=self.timeout_s)

    def close(self) -> None:
        self.conn.close()
        if self._own_ctx:
            self.ctx.term()
