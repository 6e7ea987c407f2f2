"""Requests written by hand to a ROUTER server (buffer shard, control plane, weight transfer):
for what a real client never sends, such as bad frames, wrong types and fields out of range."""

from __future__ import annotations

from typing import Any

import msgspec
import zmq

from sluice.net import zmq_socket


class RawPeer:
    """A DEALER connected to `endpoint` (linger 0). Messages go as `[b"", *frames]`, the
    envelope a REQ socket would add; every receive has a time-out, so a server that does not
    answer fails the test instead of hanging it. Close it (or use it as a context manager)."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = zmq_socket(ctx, zmq.DEALER)
        self.sock.connect(endpoint)

    def send(self, frames: list[bytes], *, delimiter: bool = True) -> None:
        """Send `frames` without waiting for the reply (several may be in flight). `delimiter`
        False leaves out the empty delimiter (the protocol allows it; the reply then has none)."""
        self.sock.send_multipart([b"", *frames] if delimiter else frames)

    def receive(self, timeout_ms: int = 5000, *, delimiter: bool = True) -> list[bytes] | None:
        """The next reply's frames after its empty delimiter (`delimiter` False: a reply that
        must have none), or None if none came within `timeout_ms`."""
        if not self.sock.poll(timeout_ms):
            return None
        reply = self.sock.recv_multipart()
        if not delimiter:
            assert reply and reply[0] != b"", f"a reply with a delimiter the request had not: {reply[:2]}"
            return reply
        assert reply[0] == b"", f"reply without the empty delimiter: {reply[:2]}"
        return reply[1:]

    def exchange(
        self, frames: list[bytes], timeout_ms: int = 5000, *, delimiter: bool = True
    ) -> list[bytes] | None:
        """Send `frames`; the reply's frames after the empty delimiter, or None if none came."""
        self.send(frames, delimiter=delimiter)
        return self.receive(timeout_ms, delimiter=delimiter)

    def ask(self, frames: list[bytes], timeout_ms: int = 5000) -> dict | None:
        """Send `frames`; the reply's msgpack header as a dict, or None if no reply came."""
        reply = self.exchange(frames, timeout_ms)
        return None if reply is None else msgspec.msgpack.decode(reply[0])

    def request(self, header: Any, *payload: bytes, timeout_ms: int = 5000) -> dict:
        """`header` (a dict or a message struct) as msgpack, then `payload`; the reply header."""
        reply = self.ask([msgspec.msgpack.encode(header), *payload], timeout_ms)
        assert reply is not None, f"no reply within {timeout_ms} ms to {header}"
        return reply

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def raw_request(ctx: zmq.Context, endpoint: str, header: Any, *payload: bytes) -> dict:
    """One hand-made request on a fresh connection; the reply header."""
    with RawPeer(ctx, endpoint) as peer:
        return peer.request(header, *payload)
