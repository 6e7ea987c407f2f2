"""The control server: a ROUTER in a thread of learner rank 0.

Socket rules: binds `control.endpoint`; rollout services and `sluice status` connect DEALERs
(or REQ). Request/reply only, small headers, no payload frames. Bad requests get an
ErrorReply naming the field and the server keeps serving. The learner thread publishes its
version and stats through `set_version` / `update_learner` (under a lock); the server thread
owns the socket.

Admission long-polls: an ADMIT with `wait_ms` that finds no quota is parked (no reply yet)
and answered, in arrival order, the moment quota frees up: a publish or a release from the
learner's threads (they wake the server through a pipe it polls beside the socket) or a
refund on the socket; else when its wait is over. A rollout that is ahead thus starts the
instant its samples would be admitted, instead of sleeping in retry slices.

Membership: a service is known from its first request. One whose last request is older than
`service_timeout_s` is gone (killed, crashed, partitioned): the server forgets it and gives
back the quota it was admitted for but did not deliver (as last reported in its heartbeats),
so the remaining services keep going. A service that comes back starts a new incarnation with
a new service id.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar, overload

import msgspec
import zmq

from sluice.control.admission import AdmissionPolicy
from sluice.control.messages import (
    AdmitReply,
    AdmitRequest,
    HeartbeatReply,
    HeartbeatRequest,
    JoinReply,
    JoinRequest,
    LeaveReply,
    LeaveRequest,
    RefundReply,
    RefundRequest,
    ServiceStatus,
    StatusReply,
    StatusRequest,
    SyncReportReply,
    SyncReportRequest,
    WeightSyncStatus,
    request_decoder,
)
from sluice.net import zmq_socket
from sluice.rpc import answer, split_envelope
from sluice.wire import codec
from sluice.wire.messages import PROTO_VERSION

if TYPE_CHECKING:
    from sluice.trajectory import Trajectory

log = logging.getLogger(__name__)
_R = TypeVar("_R", AdmitReply, RefundReply)

MEMBERSHIP_REQUESTS = (JoinRequest, LeaveRequest, SyncReportRequest)
GONE_CHECK_S = 0.25  # how often the server looks for services silent past service_timeout_s


def samples_by_service(trajs: Iterable[Trajectory]) -> Counter[str]:
    """How many of `trajs` each service produced (its incarnation id starts every group id):
    what a consumer reports to `ControlServer.seen`."""
    return Counter(t.group_id.split("/", 1)[0] for t in trajs)


class MembershipRegistry(Protocol):
    """Weight-sync membership, owned by the learner's broadcaster (weight_sync.membership).
    Called from the server thread; the registry does its own locking."""

    def handle(
        self, req: JoinRequest | LeaveRequest | SyncReportRequest
    ) -> JoinReply | LeaveReply | SyncReportReply:
        """The reply to a membership request (with the request's id). ValueError: a bad field
        (the client gets BAD_HEADER)."""
        ...

    def status(self) -> WeightSyncStatus:
        """Epoch, members and counters for STATUS."""
        ...

    def admissible(self, service_id: str) -> int:
        """The weights version work admitted for member `service_id` is generated with at least
        (-1: none known)."""
        ...

    def verified(self, service_id: str) -> int:
        """The newest version member `service_id` reported verified (-1: none)."""
        ...

    def watch_announcements(self, callback: Callable[[], None]) -> None:
        """Call `callback()` whenever newer weights are announced."""
        ...


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
        self._delivered: dict[str, int] = {}  # per service: samples it says it PUT (ADMIT, HEARTBEAT)
        self._seen: dict[str, int] = {}  # per service: its samples that reached the learner
        # per service: the last ADMIT/REFUND answered with a seq, as (seq, reply): a re-send of
        # that seq (its answer was late) gets the same reply again instead of a second grant
        self._answered: dict[str, tuple[int, AdmitReply | RefundReply]] = {}
        self.services_gone = 0
        self._next_gone_check = 0.0
        self.requests = 0  # requests received (STATUS: the control plane's load)
        self.serve_s = 0.0  # seconds the server thread spent on them (its busy share)
        self._lock = threading.Lock()
        self._version = 0
        self._published = 0
        self._learner: dict[str, float] = {}
        self._services: dict[str, tuple[str, float, dict[str, float]]] = {}
        self._membership: MembershipRegistry | None = None
        self._ctx = ctx or zmq.Context.instance()
        self.sock = zmq_socket(self._ctx, zmq.ROUTER)
        self.sock.bind(bind)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)  # as bound (`host:*`: a free port)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="control-server", daemon=True)
        # ADMITs waiting for quota: (envelope, request, deadline); served by the server thread
        self._parked: deque[tuple[list[bytes], AdmitRequest, float]] = deque()
        self._wake_r, self._wake_w = os.pipe()  # learner threads -> server thread: quota changed
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

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
        self._wake()

    def seen(self, counts: dict[str, int]) -> None:
        """The learner reports how many samples of each service (its incarnation id, which starts
        every group id) reached it: what a dead service is credited with when that is more than
        it last reported (samples it PUT after its last report)."""
        with self._lock:
            for sid, n in counts.items():
                if sid in self._last_seen:
                    self._seen[sid] = self._seen.get(sid, 0) + n

    def release(self, n: int) -> None:
        """The learner reports samples that were dropped instead of consumed."""
        if n:
            with self._lock:
                self.admission.release(n)
            self._wake()

    def charge(self, n: int) -> None:
        """The learner reports consumed samples that came back into flight (AdmissionPolicy.charge)."""
        if n:
            with self._lock:
                self.admission.charge(n)

    def attach_membership(self, registry: MembershipRegistry) -> None:
        """Serve JOIN / LEAVE / SYNC_REPORT with the learner's weight-sync membership (the
        registry does its own locking; STATUS then reports it too)."""
        with self._lock:
            self._membership = registry
        registry.watch_announcements(self._wake)  # parked ADMITs may be granted on them

    def update_learner(self, stats: dict[str, float]) -> None:
        with self._lock:
            self._learner = dict(stats)

    def close(self) -> None:
        self._stop.set()
        self._wake()
        self._thread.join(timeout=5)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):  # a full pipe is a pending wake-up already
            pass

    # -- thread --------------------------------------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(self._poll_ms()))
                if self._wake_r in ready:
                    _drain(self._wake_r)
                if self.sock in ready:
                    t0 = time.perf_counter()
                    self._serve_one()
                    self.requests += 1
                    self.serve_s += time.perf_counter() - t0
                self._serve_parked()
                self._forget_gone_services()
            self._serve_parked()  # stopping: every waiter gets its answer (0 if no room)
        finally:
            self.sock.close(linger=0)

    def _poll_ms(self) -> int:
        if not self._parked:
            return 100
        return max(0, min(100, int((self._parked[0][2] - time.monotonic()) * 1000) + 1))

    def _serve_one(self) -> None:
        frames = self.sock.recv_multipart(copy=False)
        envelope, body = split_envelope(frames)
        if envelope is None:
            return
        reply = self._handle(body)
        if isinstance(reply, _Park):
            self._park(envelope, reply.request)
            return
        self.sock.send_multipart([*envelope, *codec.encode(reply)])

    def _park(self, envelope: list[bytes], req: AdmitRequest) -> None:
        """Hold an ADMIT for quota. A re-send of a parked one takes its place: the client
        waits for the re-send's reply (it dropped the original's id)."""
        if req.seq > 0:
            self._parked = deque(
                p for p in self._parked if (p[1].service_id, p[1].seq) != (req.service_id, req.seq)
            )
        self._parked.append((envelope, req, time.monotonic() + req.wait_ms / 1000))

    def _serve_parked(self) -> None:
        """Answer parked ADMITs in arrival order: those quota now admits, and those whose wait
        is over (granted 0: ask again). One that still waits keeps those behind it waiting too,
        so a service asking for a large grant is not overtaken forever by small ones."""
        now = time.monotonic()
        while self._parked:
            envelope, req, deadline = self._parked[0]
            with self._lock:
                room = self.admission.quota(self._weights_for(req)) - self.admission.started
                if room < req.group_size and now < deadline and not self._stop.is_set():
                    break
                reply = self._admit(req, park=False)
            self._parked.popleft()
            self.sock.send_multipart([*envelope, *codec.encode(reply)])

    def _handle(self, body):
        return answer(body, request_decoder, self._dispatch_locked, "control")

    def _dispatch_locked(self, request):
        with self._lock:
            return self._dispatch(request)

    def _forget_gone_services(self) -> None:
        """At most every GONE_CHECK_S: the scan is over every service, and running it after each
        request made the server's work grow with the square of the services."""
        now = time.monotonic()
        if now < self._next_gone_check:
            return
        self._next_gone_check = now + min(GONE_CHECK_S, self.service_timeout_s / 10)
        with self._lock:
            gone = [sid for sid, t in self._last_seen.items() if now - t > self.service_timeout_s]
            for sid in gone:
                delivered = max(self._delivered.pop(sid, 0), self._seen.pop(sid, 0))
                released = self.admission.forget(sid, delivered)
                del self._last_seen[sid]
                self._services.pop(sid, None)
                self._answered.pop(sid, None)
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
        if isinstance(req, AdmitRequest | HeartbeatRequest) and req.delivered >= 0:  # counts only grow
            self._delivered[req.service_id] = max(self._delivered.get(req.service_id, 0), req.delivered)
        if isinstance(req, AdmitRequest | RefundRequest) and (again := self._answered_before(req)):
            return again
        if isinstance(req, AdmitRequest):
            return self._admit(req, park=req.wait_ms > 0)
        if isinstance(req, RefundRequest):
            if req.n < 0:
                raise ValueError(f"n={req.n} must be >= 0")
            self.admission.refund(req.service_id, req.n)
            return self._remember(req, RefundReply(proto=p, id=req.id))
        if isinstance(req, HeartbeatRequest):
            self._services[req.service_id] = (req.role, time.monotonic(), dict(req.stats))
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
                    "requests": float(self.requests),  # control-server load, not admission proper
                    "serve_s": self.serve_s,
                },
                weight_sync=None if self._membership is None else self._membership.status(),
            )
        if isinstance(req, MEMBERSHIP_REQUESTS):
            return self._membership_op(req)
        raise codec.ProtocolError("BAD_HEADER", f"unhandled op {type(req).__name__}")

    @overload
    def _admit(self, req: AdmitRequest, park: Literal[False]) -> AdmitReply: ...
    @overload
    def _admit(self, req: AdmitRequest, park: bool) -> AdmitReply | _Park: ...
    def _admit(self, req: AdmitRequest, park: bool) -> AdmitReply | _Park:
        """Under the lock. Quota follows the weights the admitted work is generated with
        (`_weights_for`). Nothing to grant and `park`: the request waits (see _serve_parked)."""
        if req.wait_ms < 0:
            raise ValueError(f"wait_ms={req.wait_ms} must be >= 0")
        weights = self._weights_for(req)
        if park and (self._parked or self.admission.quota(weights) <= self.admission.started):
            return _Park(req)  # behind earlier waiters, or no room: wait for quota
        granted = self.admission.admit(req.service_id, req.n, req.group_size, weights)
        if granted == 0 and park:
            return _Park(req)
        reply = AdmitReply(
            proto=PROTO_VERSION,
            id=req.id,
            granted=granted,
            version=self._version,
            weights_version=weights,
            retry_after_ms=0 if granted >= req.n or req.wait_ms > 0 else self.retry_after_ms,
            ahead=weights > self._held_by(req),
        )
        return self._remember(req, reply) if granted else reply

    def _weights_for(self, req: AdmitRequest) -> int:
        """Under the lock: the weights version `req`'s work will be generated with at least.
        The published one (every member verified it), or newer where the asking service's
        receiver is sent a newer one (a member of the current epoch: the version announced) or
        reported one verified: the service takes its newest weights before it generates, so
        its grant waits neither for the slowest member nor for its own report
        (docs/architecture.md, "Where a version's first generation waits")."""
        if not req.member or self._membership is None:
            return self._published
        return max(self._published, self._membership.admissible(req.member))

    def _held_by(self, req: AdmitRequest) -> int:
        """Under the lock: the newest weights the asking service is known to hold: published,
        or its own receiver's newest reported verified."""
        if not req.member or self._membership is None:
            return self._published
        return max(self._published, self._membership.verified(req.member))

    def _remember(self, req: AdmitRequest | RefundRequest, reply: _R) -> _R:
        """Under the lock: keep the answer to a sequenced request for its re-send."""
        if req.seq > 0:
            self._answered[req.service_id] = (req.seq, reply)
        return reply

    def _answered_before(self, req: AdmitRequest | RefundRequest) -> AdmitReply | RefundReply | None:
        """The answer already given to this (service, seq), under the re-send's id, or None."""
        seq, reply = self._answered.get(req.service_id, (0, None))
        if req.seq <= 0 or seq != req.seq or reply is None:
            return None
        expected = AdmitReply if isinstance(req, AdmitRequest) else RefundReply
        if not isinstance(reply, expected):
            raise codec.ProtocolError("BAD_HEADER", f"seq {req.seq} of {req.service_id} was another op")
        return msgspec.structs.replace(reply, id=req.id)

    def _membership_op(self, req):
        if self._membership is None:
            raise codec.ProtocolError(
                "BAD_HEADER", f"{type(req).__name__}: this control server serves no weight-sync membership"
            )
        return self._membership.handle(req)


class _Park:
    """What the dispatcher returns for an ADMIT that must wait for quota (no reply yet)."""

    def __init__(self, request: AdmitRequest) -> None:
        self.request = request


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
