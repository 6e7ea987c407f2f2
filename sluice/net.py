"""Small ZeroMQ and socket helpers shared by every role."""

from __future__ import annotations

import socket
from contextlib import closing

import zmq


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the caller binds it soon after)."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = "0.0.0.0") -> list[int]:
    """`n` distinct TCP ports that were free a moment ago (all held open while choosing)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def zmq_socket(ctx: zmq.Context, kind: int, *, linger_ms: int = 0, hwm: int = 1000) -> zmq.Socket:
    """A socket with an explicit linger (never hang at close) and high-water marks."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    return sock
