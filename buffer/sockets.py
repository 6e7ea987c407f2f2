"""The only two places buffer sockets are made: the shard's ROUTER and a client's DEALER.

Security (e.g. CURVE keys) and transport options belong here, so that every buffer socket gets
them and nothing else in `buffer/` calls `ctx.socket` directly.
"""

from __future__ import annotations

from typing import cast

import zmq

from sluice.net import zmq_socket

# ZMTP heartbeats: a peer that vanishes without closing its TCP connection (a cut cable, a
# frozen host) is declared disconnected after HEARTBEAT_TIMEOUT_MS instead of never.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000


# Plain ints: pyzmq's flag enums cost microseconds per use, and these run for every frame.
_NOBLOCK, _SNDMORE, _RCVMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE), int(zmq.RCVMORE)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


def recv_frames(sock: zmq.Socket) -> list[zmq.Frame] | None:
    """The next whole multipart message (zero-copy frames) if one is queued, else None.
    (Asks EVENTS first: a receive that finds nothing raises, which costs more than a request.)"""
    if not cast(int, sock.get(_EVENTS)) & _POLLIN:  # EVENTS is an int option
        return None
    try:
        frames = [sock.recv(_NOBLOCK, copy=False)]
    except zmq.Again:
        return None
    while sock.get(_RCVMORE):  # the parts of a message arrive together
        frames.append(sock.recv(_NOBLOCK, copy=False))
    return frames


def send_frames(sock: zmq.Socket, frames: list, nonblocking: bool = False) -> None:
    """send_multipart(frames, copy=False), without the per-frame enum arithmetic. Raises
    zmq.Again (nonblocking) only before the first part is taken: a message goes whole or not."""
    flags = _NOBLOCK if nonblocking else 0
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        sock.send(frame, flags | _SNDMORE if i < last else flags, copy=False)


def shard_socket(ctx: zmq.Context, bind_endpoint: str, *, max_message_bytes: int, hwm: int) -> zmq.Socket:
    """A shard's ROUTER, bound. A message above `max_message_bytes` closes its sender's connection;
    replies to a peer that is gone are dropped (ROUTER_MANDATORY off)."""
    sock = zmq_socket(ctx, zmq.ROUTER, hwm=hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    sock.bind(bind_endpoint)
    return sock


def client_socket(
    ctx: zmq.Context, endpoint: str, *, hwm: int, monitor_events: int
) -> tuple[zmq.Socket, zmq.Socket]:
    """A client's DEALER to one shard, connected, and its monitor (a PAIR receiving
    `monitor_events`), attached before the connect so that no connection event is missed.
    IMMEDIATE: a send is refused (zmq.Again) while the connection is not up, so a client knows
    a request was not sent and may route elsewhere."""
    sock = zmq_socket(ctx, zmq.DEALER, hwm=hwm)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    monitor = sock.get_monitor_socket(monitor_events)
    sock.connect(endpoint)
    return sock, monitor
