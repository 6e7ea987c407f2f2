"""Small ZeroMQ and socket helpers shared by every role."""

from __future__ import annotations

import socket
from contextlib import closing

import zmq


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago. Racy: it is released before whoever uses it binds
    it, and another process may take it meanwhile. Only for a port that must be known before
    its server exists (the launcher writes the ports of child processes into their config); a
    server in this process binds `tcp://host:*` and reads the port back (`.endpoint`)."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = "0.0.0.0") -> list[int]:
    """`n` distinct TCP ports that were free a moment ago (all held open while choosing, then
    released: racy as `free_port` is)."""
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
