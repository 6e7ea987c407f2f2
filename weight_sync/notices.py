"""Store-change notices: receivers sleep on a ZeroMQ SUB socket until the learner says it wrote
a key they wait on, instead of asking the store every few milliseconds.

The store stays the source of truth (a key cannot be missed); a notice says "look now". The
learner's `NoticePublisher` sends a message on a PUB socket after each write a receiver waits
for (an announcement, a bucket's checksums, an epoch's commit or abort); a receiver's
`NoticeListener`, subscribed before it reads the store, wakes at once, reads, and sleeps again.
A notice lost (sent before the subscription was up) costs at most the listener's fallback
interval. Why: two receivers asking every 5 ms took ~8% of a core each on the vs_trl workload
and woke on the learner's core (docs/architecture.md, "Weight sync").

A notice may carry the key it follows and the value that key now holds (an announcement, the
checksums appended so far): the listener keeps the last few, and a receiver that finds its key
there reads no further. That takes the store's round trips (check, get: each a wake-up of the
store's thread and of the receiver's) off the path from a publish to the first generation on
it. A carried value is what the store holds, written before the notice was sent; without one
the receiver reads the store as before.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict

import zmq

from sluice.net import zmq_socket

NOTICE_FALLBACK_S = 0.05  # a listener looks at the store at least this often
CARRIED_KEEP = 16  # carried values a listener keeps (the newest)


class NoticePublisher:
    """The learner's PUB socket. `notify` may be called from any thread (the confirmation,
    checksum and training threads all write keys); a lock serialises the socket."""

    def __init__(self, ctx: zmq.Context, host: str) -> None:
        self._lock = threading.Lock()
        self._sock: zmq.Socket | None = zmq_socket(ctx, zmq.PUB, hwm=64)
        self.endpoint = f"tcp://{host}:{self._sock.bind_to_random_port(f'tcp://{host}')}"

    def notify(self, key: str = "", value: bytes = b"") -> None:
        """Tell every listener the store changed: with `key`, that `key` now holds `value`
        (written to the store before this call). Never blocks: a listener that has not
        drained its queue (64 notices) needs no more of them."""
        with self._lock:
            if self._sock is None:
                return
            try:
                self._sock.send_multipart([key.encode(), value], zmq.NOBLOCK)
            except zmq.Again:
                pass

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close(linger=0)
                self._sock = None


class NoticeListener:
    """A receiver's SUB socket on the learner's `NoticePublisher`; one thread uses it."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self._sock = zmq_socket(ctx, zmq.SUB, hwm=64)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)
        self._carried: OrderedDict[str, bytes] = OrderedDict()
        self.carrying = False  # a notice carried a value: the learner's notices do

    def wait(self, timeout_s: float) -> bool:
        """Sleep until a notice comes or `timeout_s` (at most NOTICE_FALLBACK_S) passes;
        True if one came. Every notice queued is taken (their carried values kept): one look
        at the store answers them."""
        timeout_ms = max(0, math.ceil(min(timeout_s, NOTICE_FALLBACK_S) * 1000))  # 1 ms, not a spin
        if not self._sock.poll(timeout_ms):
            return False
        while self._sock.poll(0):
            self._keep(self._sock.recv_multipart(zmq.NOBLOCK))
        return True

    def look_every_s(self) -> float:
        """How often a reader waiting on a key should look at the store itself: where the
        notices carry values, every NOTICE_FALLBACK_S (a notice lost, a value no longer
        kept); else at once (and again after every notice)."""
        return NOTICE_FALLBACK_S if self.carrying else 0.0

    def carried(self, key: str) -> bytes | None:
        """The value the newest notice about `key` carried, if one did and is still kept."""
        return self._carried.get(key)

    def _keep(self, frames: list[bytes]) -> None:
        if len(frames) != 2 or not frames[0]:
            return  # a bare "look now" (or a frame this version does not know): nothing to keep
        key = frames[0].decode(errors="replace")
        self.carrying = True
        self._carried.pop(key, None)
        self._carried[key] = frames[1]
        while len(self._carried) > CARRIED_KEEP:
            self._carried.popitem(last=False)

    def close(self) -> None:
        self._sock.close(linger=0)
