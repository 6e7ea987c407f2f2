"""The control server: a ROUTER in a thread of learner rank 0.

Socket rules: binds `control.endpoint`; rollout services and `sluice status` connect DEALERs
(or REQ). Request/reply only, small headers, no payload frames. Bad requests get an
ErrorReply naming the field and the server keeps serving. The learner thread publishes its
version and stats through `set_version` / `update_learner` (under a lock); the server thread
owns the socket.

Membership: a service is known from its first request. One whose last request is older than
`service_timeout_s` is gone (killed, crashed, partitioned): the server forgets it and gives
back the quota it was admitted for but did not deliver (as last reported in its heartbeats),
so the remaining services keep going. A service that comes back starts a new incarnation with
a new service id.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

import zmq

from sluice.control.admission import AdmissionPolicy
from sluice.control.messages import (
    AdmitReply,
    AdmitRequest,
    HeartbeatReply,
    HeartbeatRequest,
    JoinRequest,
    LeaveRequest,
    RefundReply,
    RefundRequest,
    ServiceStatus,
    StatusReply,
    StatusRequest,
    SyncReportRequest,
    WeightSyncStatus,
    request_decoder,
)
from sluice.net import zmq_socket
from sluice.rpc import split_envelope
from sluice.wire import codec
from sluice.wire.messages import PROTO_VERSION

log = logging.getLogger(__name__)

MEMBERSHIP_REQUESTS = (JoinRequest, LeaveRequest, SyncReportRequest)


class MembershipRegistry(Protocol):
    """Weight-sync membership, owned by the learner's broadcaster (weight_sync.membership).
    Called from the server thread; the registry does its own locking."""

    def handle(self, req: JoinRequest | LeaveRequest | SyncReportRequest):
        """The reply to a membership request (JoinReply, LeaveReply or SyncReportReply with
        the request's id). ValueError: a bad field (the client gets BAD_HEADER)."""

    def status(self) -> WeightSyncStatus:
        """Epoch, members and counters for STATUS."""


class ControlServer:
    def __init__(
        self,
        bind: str,
        admission: AdmissionPolicy,
        *,
        retry_after_ms: int = 50,
        service_timeout_s: float = 30.0,
        ctx: zmq.Context | None = None,
    ) -> None:
        self.admission = admission
        self.retry_after_ms = retry_after_ms
        self.service_timeout_s = service_timeout_s
        self._last_seen: dict[str, float] = {}
        self._delivered: dict[str, int] = {}
        self.services_gone = 0
        self._lock = threading.Lock()
        self._version = 0
        self._published = 0
        self._learner: dict[str, float] = {}
        self._services: dict[str, tuple[str, float, dict[str, float]]] = {}
        self._membership: MembershipRegistry | None = None
        self._ctx = ctx or zmq.Context.instance()
        self.sock = zmq_socket(self._ctx, zmq.ROUTER)
        self.sock.bind(bind)
        self.endpoint = bind
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="control-server", daemon=True)

    # -- learner-facing ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def set_version(self, version: int) -> None:
        with self._lock:
            self._version = version

    def set_published(self, version: int) -> None:
        """Weights of `version` reached every receiver."""
        with self._lock:
            self._published = version

    def release(self, n: int) -> None:
        """The learner reports samples that were dropped instead of consumed."""
        if n:
            with self._lock:
                self.admission.release(n)

    def attach_membership(self, registry: MembershipRegistry) -> None:
        """Serve JOIN / LEAVE / SYNC_REPORT with the learner's weight-sync membership (the
        registry does its own locking; STATUS then reports it too)."""
        with self._lock:
            self._membership = registry

    def update_learner(self, stats: dict[str, float]) -> None:
        with self._lock:
            self._learner = dict(stats)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    # -- thread --------------------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.sock.poll(100):
                    self._forget_gone_services()
                    continue
                frames = self.sock.recv_multipart(copy=False)
                envelope, body = split_envelope(frames)
                if envelope is None:
                    continue
                reply = self._handle(body)
                self.sock.send_multipart([*envelope, *codec.encode(reply)])
                self._forget_gone_services()
        finally:
            self.sock.close(linger=0)

    def _handle(self, body):
        request_id = -1
        try:
            request, payload = codec.decode_request(body, request_decoder)
            request_id = request.id
            if payload:
                raise codec.ProtocolError("BAD_PAYLOAD", "control requests take no payload frames")
            with self._lock:
                return self._dispatch(request)
        except codec.ProtocolError as e:
            return codec.error_reply(getattr(e, "request_id", request_id), e.code, e.message)
        except ValueError as e:
            return codec.error_reply(request_id, "BAD_HEADER", str(e))
        except Exception as e:  # noqa: BLE001 - a bug must not stop the control plane
            log.exception("control server: internal error")
            return codec.error_reply(request_id, "INTERNAL", repr(e))

    def _forget_gone_services(self) -> None:
        now = time.monotonic()
        with self._lock:
            gone = [sid for sid, t in self._last_seen.items() if now - t > self.service_timeout_s]
            for sid in gone:
                released = self.admission.forget(sid, self._delivered.pop(sid, 0))
                del self._last_seen[sid]
                self._services.pop(sid, None)
                self.services_gone += 1
                log.warning(
                    "control: %s silent for %.0fs, gone; released %d samples of quota",
                    sid,
                    self.service_timeout_s,
                    released,
                )

    def _dispatch(self, req):
        p = PROTO_VERSION
        if hasattr(req, "service_id"):
            self._last_seen[req.service_id] = time.monotonic()
        if isinstance(req, AdmitRequest):
            # Quota follows the published weights: admitted work is generated with them.
            granted = self.admission.admit(req.service_id, req.n, req.group_size, self._published)
            retry = 0 if granted >= req.n else self.retry_after_ms
            return AdmitReply(
                proto=p,
                id=req.id,
                granted=granted,
                version=self._version,
                weights_version=self._published,
                retry_after_ms=retry,
            )
        if isinstance(req, RefundRequest):
            if req.n < 0:
                raise ValueError(f"n={req.n} must be >= 0")
            self.admission.refund(req.service_id, req.n)
            return RefundReply(proto=p, id=req.id)
        if isinstance(req, HeartbeatRequest):
            self._services[req.service_id] = (req.role, time.monotonic(), dict(req.stats))
            if req.delivered >= 0:
                self._delivered[req.service_id] = req.delivered
            return HeartbeatReply(proto=p, id=req.id, version=self._version, weights_version=self._published)
        if isinstance(req, StatusRequest):
            now = time.monotonic()
            services = {
                sid: ServiceStatus(role=role, age_s=now - t, stats=stats)
                for sid, (role, t, stats) in self._services.items()
            }
            adm = self.admission
            return StatusReply(
                proto=p,
                id=req.id,
                learner={"version": float(self._version), **self._learner},
                services=services,
                admission={
                    "started": float(adm.started),
                    "quota": float(adm.quota(self._published)),
                    "refused_asks": float(adm.refused_asks),
                    "released_gone": float(adm.released_gone),
                    "services_gone": float(self.services_gone),
                },
                weight_sync=None if self._membership is None else self._membership.status(),
            )
        if isinstance(req, MEMBERSHIP_REQUESTS):
            return self._membership_op(req)
        raise codec.ProtocolError("BAD_HEADER", f"unhandled op {type(req).__name__}")

    def _membership_op(self, req):
        if self._membership is None:
            raise codec.ProtocolError(
                "BAD_HEADER", f"{type(req).__name__}: this control server serves no weight-sync membership"
            )
        return self._membership.handle(req)
