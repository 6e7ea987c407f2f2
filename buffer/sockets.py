"""The only two places buffer sockets are made: the shard's ROUTER and a client's DEALER.

Security (e.g. CURVE keys) and transport options belong here, so that every buffer socket gets
them and nothing else in `buffer/` calls `ctx.socket` directly.
"""

from __future__ import annotations

import zmq

from sluice.net import zmq_socket

# ZMTP heartbeats: a peer that vanishes without closing its TCP connection (a cut cable, a
# frozen host) is declared disconnected after HEARTBEAT_TIMEOUT_MS instead of never.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000


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
