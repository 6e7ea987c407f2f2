"""The control server: a ROUTER in a thread of learner rank 0.

Socket rules: binds `control.endpoint`; rollout services and `sluice status` connect DEALERs
(or REQ). Request/reply only, small headers, no payload frames. Bad requests get an
ErrorReply naming the field and the server keeps serving. The learner thread publishes its
version and stats through `set_version` / `update_learner` (under a lock); the server thread
owns the socket.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from sluice.control.admission import AdmissionPolicy
from sluice.control.messages import (
    AdmitReply,
    AdmitRequest,
    HeartbeatReply,
    HeartbeatRequest,
    RefundReply,
    RefundRequest,
    ServiceStatus,
    StatusReply,
    StatusRequest,
    request_decoder,
)
from sluice.net import zmq_socket
from sluice.rpc import split_envelope
from sluice.wire import codec
from sluice.wire.messages import PROTO_VERSION

log = logging.getLogger(__name__)


class ControlServer:
    def __init__(
        self,
        bind: str,
        admission: AdmissionPolicy,
        *,
        retry_after_ms: int = 50,
        ctx: zmq.Context | None = None,
    ) -> None:
        self.admission = admission
        self.retry_after_ms = retry_after_ms
        self._lock = threading.Lock()
        self._version = 0
        self._published = 0
        self._learner: dict[str, float] = {}
        self._services: dict[str, tuple[str, float, dict[str, float]]] = {}
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
                    continue
                frames = self.sock.recv_multipart(copy=False)
                envelope, body = split_envelope(frames)
                if envelope is None:
                    continue
                reply = self._handle(body)
                self.sock.send_multipart([*envelope, *codec.encode(reply)])
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

    def _dispatch(self, req):
        p = PROTO_VERSION
        if isinstance(req, AdmitRequest):
            granted = self.admission.admit(req.service_id, req.n, req.group_size, self._version)
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
            return HeartbeatReply(proto=p, id=req.id, version=self._version)
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
                    "quota": float(adm.quota(self._version)),
                    "refused_asks": float(adm.refused_asks),
                },
            )
        raise codec.ProtocolError("BAD_HEADER", f"unhandled op {type(req).__name__}")
