"""Small ZeroMQ and socket helpers shared by every role."""

from __future__ import annotations

import random
import resource
import socket
from contextlib import closing
from pathlib import Path

import zmq

PRIVATE_PORT_FLOOR = 20000  # below: Ray's worker ports (10002-19999) and other fixed services
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, for tests and tools that cannot hold one
    (`HeldPorts`). Racy: it is released before whoever uses it binds it. Drawn from below the
    kernel's ephemeral range, where no `bind(0)` or outgoing connection can take it, or the
    kernel's choice where that range leaves no room (docs/architecture.md, "Local launcher")."""
    low = ephemeral_range()[0]
    draw = random.SystemRandom()
    for _ in range(64 if low - PRIVATE_PORT_FLOOR >= 1000 else 0):
        port = draw.randrange(PRIVATE_PORT_FLOOR, low)
        with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it chooses itself (Linux's default where unreadable)."""
    try:
        low, high = EPHEMERAL_RANGE.read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


class HeldPorts:
    """Ports for servers that other processes must know before they exist, each kept bound by
    this process until `close()` so that the kernel gives it to no one else meanwhile. A held
    socket is bound with SO_REUSEADDR and never listens, so a server that also sets it (ZeroMQ,
    torch's TCPStore) still binds and listens there (docs/architecture.md, "Local launcher")."""

    def __init__(self) -> None:
        self._socks: list[socket.socket] = []

    def take(self, host: str = "0.0.0.0") -> int:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # not inherited by children (PEP 446)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, 0))
        except OSError:
            s.close()
            raise
        self._socks.append(s)
        return s.getsockname()[1]

    def close(self) -> None:
        for s in self._socks:
            s.close()
        self._socks.clear()

    def __enter__(self) -> HeldPorts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
