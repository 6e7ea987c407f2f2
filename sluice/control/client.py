"""Client of the control server (rollout services, `sluice status`). Not thread-safe."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import TypeVar

import zmq

from sluice.control import messages as msg
from sluice.rpc import RpcConnection, RpcTimeout
from sluice.wire.codec import ProtocolError
from sluice.wire.messages import PROTO_VERSION

R = TypeVar("R")
log = logging.getLogger(__name__)


class ControlClient:
    """`patience_s` > 0: an ADMIT or REFUND the learner does not answer within `timeout_s` is
    sent again, with the same sequence number, until `patience_s` has passed (a paused learner
    is waited for; the server answers a repeat once). 0: the first time-out raises.
    `should_abort`: asked while any call waits; true raises RpcAborted (a service that stops,
    or whose learner is gone, does not wait out the patience)."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float = 10.0,
        ctx: zmq.Context | None = None,
        patience_s: float = 0.0,
        should_abort: Callable[[], bool] | None = None,
    ) -> None:
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.conn = RpcConnection(self.ctx, endpoint, name="control", reply_decoder=msg.reply_decoder)
        self.timeout_s = timeout_s
        self.patience_s = patience_s
        self.should_abort = should_abort  # true: a waiting call raises RpcAborted (the caller stops)
        self._seq = itertools.count(1)

    @property
    def endpoint(self) -> str:
        return self.conn.endpoint

    def _call_patiently(self, request_type: type, reply_type: type[R], timeout_s: float, **fields) -> R:
        """`_call` with this client's next sequence number, re-sent on time-outs (class docstring)."""
        seq = next(self._seq) if self.patience_s > 0 else 0
        give_up = time.monotonic() + self.patience_s
        while True:
            try:
                return self._call(request_type, reply_type, timeout_s, seq=seq, **fields)
            except RpcTimeout as e:
                if time.monotonic() + timeout_s > give_up:
                    raise
                log.warning("%s; asking again (seq %d, giving up after %.0fs)", e, seq, self.patience_s)

    def _call(self, request_type: type, reply_type: type[R], timeout_s: float | None = None, **fields) -> R:
        """Send one request of `request_type` (proto and id filled in) and return the reply, which
        must be a `reply_type` (any other is a broken server: ProtocolError)."""
        req = request_type(proto=PROTO_VERSION, id=self.conn.next_id(), **fields)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        reply = self.conn.request(req, timeout_s=timeout_s, abort=self.should_abort)[0]
        if not isinstance(reply, reply_type):
            raise ProtocolError(
                "BAD_REPLY", f"control: {type(reply).__name__} in answer to {request_type.__name__}"
            )
        return reply

    def admit(
        self,
        service_id: str,
        n: int,
        group_size: int,
        wait_ms: int = 0,
        delivered: int = -1,
        member: str = "",
    ) -> msg.AdmitReply:
        """`wait_ms` > 0 long-polls: the reply comes when quota frees up or after wait_ms.
        `member`: the service's weight-sync id (AdmitRequest.member)."""
        return self._call_patiently(
            msg.AdmitRequest, msg.AdmitReply, self.timeout_s + wait_ms / 1000,
            service_id=service_id, n=n, group_size=group_size, wait_ms=wait_ms, delivered=delivered,
            member=member,
        )  # fmt: skip

    def refund(self, service_id: str, n: int) -> None:
        self._call_patiently(msg.RefundRequest, msg.RefundReply, self.timeout_s, service_id=service_id, n=n)

    def heartbeat(
        self, service_id: str, role: str, stats: dict[str, float], delivered: int = -1
    ) -> msg.HeartbeatReply:
        return self._call(
            msg.HeartbeatRequest,
            msg.HeartbeatReply,
            service_id=service_id,
            role=role,
            stats=stats,
            delivered=delivered,
        )

    def status(self) -> msg.StatusReply:
        return self._call(msg.StatusRequest, msg.StatusReply)

    # -- weight-sync membership ------------------------------------------------------------------

    def join(
        self, service_id: str, incarnation: str, held_version: int, device: str = "cpu", pid: int = 0
    ) -> msg.JoinReply:
        return self._call(
            msg.JoinRequest, msg.JoinReply, service_id=service_id, incarnation=incarnation,
            held_version=held_version, device=device, pid=pid,
        )  # fmt: skip

    def leave(self, service_id: str, incarnation: str = "", pid: int = 0) -> msg.LeaveReply:
        """A receiver leaves (`incarnation`), or a launcher reports its process dead (`pid`)."""
        return self._call(
            msg.LeaveRequest, msg.LeaveReply, service_id=service_id, incarnation=incarnation, pid=pid
        )

    def sync_report(
        self,
        service_id: str,
        incarnation: str,
        *,
        epoch: int,
        version: int,
        outcome: msg.SyncOutcome,
        error: str = "",
    ) -> None:
        self._call(
            msg.SyncReportRequest, msg.SyncReportReply, service_id=service_id, incarnation=incarnation,
            epoch=epoch, version=version, outcome=outcome, error=error,
        )  # fmt: skip

    def close(self) -> None:
        self.conn.close()
        if self._own_ctx:
            self.ctx.term()
