"""A client's connection to one shard: its DEALER, whether it is up, and its requests in flight.

Socket rules:
- One DEALER per shard (`buffer/sockets.py`), connected, with IMMEDIATE: a send while the
  connection is not up is refused on the spot (`NotSent`), so the caller knows the request
  was not delivered and may route a new group to another shard.
- A monitor socket (inproc PAIR) reports handshakes and disconnects. A disconnect fails every
  request in flight on that shard at once (`Lost`: sent, outcome unknown) instead of letting
  it wait for its timeout, so a killed shard costs milliseconds, not `timeout_s`.
- A request that times out also fails as `Lost`; the socket is then closed and reopened
  (linger 0), dropping anything still queued for the shard and any late reply.
- Several requests may be in flight per shard; replies are matched by id, replies with an
  unknown id (to requests already failed) are discarded.
- After a failure the shard is skipped for a backoff (exponential with jitter, capped) except
  where the caller must reach this shard in particular (a sent PUT, an ACK).
- Same host (`same_host="auto"`): before its first request on a connection the link sends
  HELLO, without waiting for it; if the reply shows the shard on this host and its token
  file is readable here, `peer` (a SameHostPeer) is set and later requests may use shared
  memory. A lost connection forgets the peer (the shard may have restarted: new token, maybe
  a new directory); a shard that refuses the token is asked again, at most
  `MAX_TOKEN_REFUSALS` times per connection, then the link stays on ZeroMQ.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import zmq
from zmq.utils.monitor import parse_monitor_message

from sluice.buffer.same_host import SameHostPeer, host_id
from sluice.buffer.sockets import client_socket, recv_frames, send_frames
from sluice.rpc import RpcError, RpcTimeout
from sluice.wire import codec
from sluice.wire.messages import PROTO_VERSION, ErrorReply, HelloReply, HelloRequest, Request

log = logging.getLogger(__name__)

MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # (plain ints: flag enums cost microseconds)
RECONNECT_GRACE_S = 0.25
MAX_TOKEN_REFUSALS = 3


class NotSent(RpcTimeout):
    """The request never left this process (the shard is not connected): safe to send elsewhere."""


class Lost(RpcTimeout):
    """The request was sent, but no reply came (timeout or disconnect): it may have been applied."""


class Abandoned(Lost):
    """The caller stopped waiting for the reply (it is stopping): it may have been applied."""


@dataclass
class Backoff:
    initial_s: float = 0.05
    max_s: float = 2.0

    def delay(self, failures: int) -> float:
        base = min(self.max_s, self.initial_s * 2 ** min(max(0, failures - 1), 30))
        return base * random.uniform(0.5, 1.0)


def wait_out(wait_s: float, should_abort: Callable[[], bool]) -> bool:
    """Sleep `wait_s` before a retry, looking at `should_abort` every 50 ms; True when it
    turned true first (the caller gives up instead of retrying: a role that stops)."""
    end = time.monotonic() + wait_s
    while not should_abort():
        left = end - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(left, 0.05))
    return True


@dataclass(eq=False)
class Call:
    """One request and, once done, its outcome: `reply` + `frames`, or `error`
    (RpcError for an error reply, NotSent, or Lost)."""

    header: Request
    payload: Sequence[Any] = ()
    timeout_s: float = 30.0
    link: ShardLink | None = None
    deadline: float = 0.0
    reply: Any = None
    frames: list = field(default_factory=list)
    error: BaseException | None = None
    done: bool = False
    peer: SameHostPeer | None = None  # the same-host peer whose token the request carries

    def finish(
        self, reply: Any = None, frames: list | None = None, error: BaseException | None = None
    ) -> None:
        self.reply, self.frames, self.error, self.done = reply, frames or [], error, True

    def sent_on(self) -> ShardLink:
        """The link `ShardLink.send` sent the call on."""
        if self.link is None:
            raise RuntimeError(f"{type(self.header).__name__} {self.header.id} was never sent")
        return self.link


class ShardLink:
    def __init__(
        self,
        ctx: zmq.Context,
        index: int,
        endpoint: str,
        *,
        backoff: Backoff,
        first_connect_s: float = 2.0,
        hwm: int = 10000,
        same_host: str = "auto",
    ) -> None:
        self.ctx = ctx
        self.index = index
        self.endpoint = endpoint
        self.name = f"shard {index} at {endpoint}"
        self.backoff = backoff
        self.first_connect_s = first_connect_s
        self.hwm = hwm
        self.pending: dict[int, Call] = {}
        self.failures = 0
        self.retry_at = 0.0
        self.ever_connected = False
        self._ids = itertools.count(1)
        self.same_host = same_host
        self.peer: SameHostPeer | None = None
        self._hello: Call | None = None
        self._hello_known = same_host != "auto"  # HELLO answered on this connection (or not wanted)
        self._refusals = 0
        self._open()

    def _open(self) -> None:
        self.sock, self.monitor = client_socket(
            self.ctx, self.endpoint, hwm=self.hwm, monitor_events=MONITOR_EVENTS
        )
        self.connected = False
        self.saw_disconnect = False  # since the last handshake of this socket
        self.opened_at = time.monotonic()

    def close(self) -> None:
        self._fail_pending(Lost(f"{self.name}: client closed"))
        self.forget_peer()
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)

    def reset(self) -> None:
        """New socket: nothing queued for the shard survives, no late reply reaches us."""
        self.close()
        self._open()

    # -- state ---------------------------------------------------------------------------------

    def available(self, now: float) -> bool:
        """Worth trying now: connected, or its backoff after a failure has passed."""
        self.pump_events()
        return self.connected or now >= self.retry_at

    @property
    def lost(self) -> bool:
        """The connection went down and has not come back (a disconnect seen since its last
        handshake): a send now is refused, where it could also slip into the dying pipe and
        vanish. A socket still making its first connection is not lost: a send waits for it."""
        return self.saw_disconnect and not self.connected

    def mark_failed(self, now: float) -> None:
        self.failures += 1
        self.retry_at = now + self.backoff.delay(self.failures)

    def mark_ok(self) -> None:
        self.failures = 0
        self.retry_at = 0.0

    def pump_events(self) -> None:
        # (EVENTS first: a NOBLOCK receive that finds nothing raises, which costs ~15 us, and
        # this runs for every request)
        while cast(int, self.monitor.get(_EVENTS)) & _POLLIN:  # EVENTS is an int option
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected = self.ever_connected = True
                self.saw_disconnect = False
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected = False
                self.saw_disconnect = True
                self.mark_failed(time.monotonic())
                self._fail_pending(Lost(f"{self.name}: connection lost with the request in flight"))
                self.forget_peer()

    def _fail_pending(self, error: BaseException) -> None:
        pending, self.pending = self.pending, {}
        for call in pending.values():
            call.finish(error=error)
            if call is self._hello:
                self._hello = None  # asked again with the next request

    # -- same host -----------------------------------------------------------------------------

    def forget_peer(self) -> None:
        """The shard may have restarted: ask again (HELLO) before using shared memory."""
        if self.peer is not None:
            self.peer.close()
            self.peer = None
        self._hello_known = self.same_host != "auto"
        self._refusals = 0

    def peer_refused(self) -> None:
        """The shard did not accept the peer's token: ask again, a few times per connection."""
        if self.peer is not None:
            self.peer.close()
            self.peer = None
        self._refusals += 1
        self._hello_known = self._refusals >= MAX_TOKEN_REFUSALS or self.same_host != "auto"

    def _send_hello(self, timeout_s: float) -> None:
        call = Call(
            HelloRequest(proto=PROTO_VERSION, id=self.next_id(), host_id=host_id()), timeout_s=timeout_s
        )
        call.link = self
        if self._send_now(call, 0):
            call.deadline = time.monotonic() + call.timeout_s
            self.pending[call.header.id] = call
            self._hello = call

    def _on_hello(self, call: Call) -> None:
        self._hello = None
        self._hello_known = True
        if isinstance(call.reply, HelloReply):
            self.peer = SameHostPeer.open(call.reply)
            if self.peer is not None:
                log.debug("%s: same host, sharing %s", self.name, self.peer.dir)

    # -- requests ------------------------------------------------------------------------------

    def next_id(self) -> int:
        return next(self._ids)

    def send(self, call: Call) -> None:
        """Send `call` (its header's id must come from `next_id`), or finish it with NotSent."""
        call.link = self
        self.pump_events()
        if not self.connected:
            # A new socket (a new client, or one just reset) gets a moment to connect before
            # the shard is called down: the first connection longer, a reconnect briefly.
            grace = (
                self.first_connect_s
                if not self.ever_connected
                else min(self.first_connect_s, RECONNECT_GRACE_S)
            )
            wait_s = grace - (time.monotonic() - self.opened_at)
            if wait_s > 0 and self.monitor.poll(int(wait_s * 1000)):
                self.pump_events()
        # Try even if no handshake was seen (unless a disconnect was: a send can still slip into
        # the dying pipe and vanish): with IMMEDIATE a send that is taken proves a connection.
        if self.connected and not self._hello_known and self._hello is None:
            self._send_hello(call.timeout_s)  # answered before `call` (one connection keeps order)
        if not self.lost and self._send_now(call, 200 if self.connected else 0):
            self.connected = self.ever_connected = True
            call.deadline = time.monotonic() + call.timeout_s
            self.pending[call.header.id] = call
            return
        self.mark_failed(time.monotonic())
        call.finish(error=NotSent(f"{self.name}: not connected; request not sent"))

    def _send_now(self, call: Call, wait_ms: int) -> bool:
        frames = [b"", *codec.encode(call.header, call.payload)]
        for attempt in range(2):
            try:
                send_frames(self.sock, frames, nonblocking=True)
                return True
            except zmq.Again:
                # The handshake event can precede the pipe's attachment by a moment.
                if attempt == 0 and not self.sock.poll(wait_ms, zmq.POLLOUT):
                    return False
        return False

    def on_readable(self) -> None:
        while True:
            frames = recv_frames(self.sock)
            if frames is None:
                return
            if frames and len(frames[0]) == 0:
                frames = frames[1:]
            reply, payload = codec.decode_reply(frames)
            call = self.pending.pop(reply.id, None)
            if call is None:
                continue  # the late answer to a request that already failed
            self.mark_ok()
            if isinstance(reply, ErrorReply):
                call.finish(error=RpcError(self.name, reply))
            else:
                call.finish(reply, payload)
            if call is self._hello:
                self._on_hello(call)  # (an error reply, e.g. from an older shard: ZeroMQ only)

    def abandon(self, call: Call) -> None:
        """Stop waiting for `call`'s reply (its caller is stopping); a late reply is dropped."""
        self.pending.pop(call.header.id, None)
        if call is self._hello:
            self._hello = None
        call.finish(error=Abandoned(f"{self.name}: {type(call.header).__name__} abandoned: stopping"))

    def expire(self, now: float) -> None:
        """Fail requests past their deadline; the shard is presumed stuck: reset the socket."""
        late = [c for c in self.pending.values() if c.deadline <= now]
        if not late:
            return
        for call in late:
            del self.pending[call.header.id]
            if call is self._hello:
                self._hello = None
            call.finish(
                error=Lost(
                    f"{self.name}: no reply to {type(call.header).__name__} within {call.timeout_s:.1f}s"
                )
            )
        self.mark_failed(now)
        self.reset()


def wait_all(
    calls: list[Call],
    links: Sequence[ShardLink],
    on_done: Callable[[Call], list[Call]] | None = None,
    should_abort: Callable[[], bool] | None = None,
) -> None:
    """Wait until every call is finished (reply, error, or its deadline). `on_done` sees each
    call as it finishes and may return new calls (already sent) to wait for as well. Once
    `should_abort` says so (looked at every <= 100 ms), the calls still open finish as Abandoned."""
    calls = list(calls)
    seen: set[int] = set()

    def notify() -> None:
        for call in list(calls):
            if call.done and id(call) not in seen:
                seen.add(id(call))
                if on_done is not None:
                    calls.extend(on_done(call))

    notify()
    while not all(c.done for c in calls):
        now = time.monotonic()
        for link in links:
            link.expire(now)
        notify()
        open_calls = [c for c in calls if not c.done]
        if not open_calls:
            break
        poller = zmq.Poller()
        active = {c.sent_on() for c in open_calls}
        for link in active:
            poller.register(link.sock, zmq.POLLIN)
            poller.register(link.monitor, zmq.POLLIN)
        wait_ms = max(0, min(c.deadline for c in open_calls) - now) * 1000
        ready = dict(poller.poll(int(min(wait_ms, 100) + 1)))  # whole ms, as pyzmq would make it
        for link in active:
            if link.monitor in ready:
                link.pump_events()
            if link.sock in ready:
                link.on_readable()
        notify()
        if should_abort is not None and should_abort():  # (after taking the replies that came)
            for call in [c for c in calls if not c.done]:
                call.sent_on().abandon(call)
            break
