"""Store-change notices: receivers sleep on a ZeroMQ SUB socket until the learner says it wrote
a key they wait on, instead of asking the store every few milliseconds.

The store stays the source of truth (a key cannot be missed); a notice only says "look now".
The learner's `NoticePublisher` sends an empty message on a PUB socket after each write a
receiver waits for (an announcement, a bucket's checksums, an epoch's commit or abort); a
receiver's `NoticeListener`, subscribed before it reads the store, wakes at once, reads, and
sleeps again. A notice lost (sent before the subscription was up) costs at most the listener's
fallback interval. Why: two receivers asking every 5 ms took ~8% of a core each on the vs_trl
workload and woke on the learner's core (docs/architecture.md, "Weight sync").
"""

from __future__ import annotations

import math
import threading

import zmq

from sluice.net import zmq_socket

NOTICE_FALLBACK_S = 0.05  # a listener looks at the store at least this often


class NoticePublisher:
    """The learner's PUB socket. `notify` may be called from any thread (the confirmation,
    checksum and training threads all write keys); a lock serialises the socket."""

    def __init__(self, ctx: zmq.Context, host: str) -> None:
        self._lock = threading.Lock()
        self._sock: zmq.Socket | None = zmq_socket(ctx, zmq.PUB, hwm=64)
        self.endpoint = f"tcp://{host}:{self._sock.bind_to_random_port(f'tcp://{host}')}"

    def notify(self) -> None:
        """Tell every listener the store changed. Never blocks: a listener that has not
        drained its queue (64 notices) needs no more of them."""
        with self._lock:
            if self._sock is None:
                return
            try:
                self._sock.send(b"", zmq.NOBLOCK)
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

    def wait(self, timeout_s: float) -> bool:
        """Sleep until a notice comes or `timeout_s` (at most NOTICE_FALLBACK_S) passes;
        True if one came. Every notice queued is taken: one look at the store answers them."""
        timeout_ms = max(0, math.ceil(min(timeout_s, NOTICE_FALLBACK_S) * 1000))  # 1 ms, not a spin
        if not self._sock.poll(timeout_ms):
            return False
        while self._sock.poll(0):
            self._sock.recv(zmq.NOBLOCK)
        return True

    def close(self) -> None:
        self._sock.close(linger=0)
