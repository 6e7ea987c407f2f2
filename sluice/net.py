"""Small ZeroMQ and socket helpers shared by every role."""

from __future__ import annotations

import resource
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


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open files (RLIMIT_NOFILE) to its hard limit, and
    return it. A server with a thousand clients holds a descriptor per connection, and a
    process that packs many services holds several sockets per service (docs/architecture.md,
    "Packed sim services"); many systems start processes with a soft limit of 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    return soft
