"""Request/reply over ZeroMQ for every Sluice server (buffer shards, the control plane).

Client side, `RpcConnection`:
- A DEALER, connected (never bound) to the server's ROUTER. Sends `[b"", header, payload...]`.
- Every request carries an id; a reply with another id (the late answer to a request that
  timed out) is discarded. No request waits longer than its timeout, to be sent or answered:
  `RpcTimeout`. A caller that may stop first passes `abort`: `RpcAborted` once it is true.
- An error reply raises `RpcError` with the server's code, message and retry hint.
- Not thread-safe: one connection per thread.

Server side, `split_envelope`: ROUTER frames -> (envelope to echo, body); `answer`: a request
that takes no payload, decoded and handled, every failure an ErrorReply (servers keep serving).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq

from sluice.net import zmq_socket
from sluice.wire import codec
from sluice.wire.messages import ErrorReply

log = logging.getLogger(__name__)
ABORT_CHECK_S = 0.1  # how often a waiting request asks its `abort`


class RpcError(RuntimeError):
    """The server answered with an error reply."""

    def __init__(self, where: str, reply: ErrorReply) -> None:
        super().__init__(f"{where}: {reply.code}: {reply.message}")
        self.where = where
        self.code = reply.code
        self.message = reply.message
        self.retry_after_ms = reply.retry_after_ms


class RpcTimeout(TimeoutError):
    """No reply within the timeout."""


class RpcAborted(RuntimeError):
    """The caller's `abort` turned true while the request waited for its reply."""


class RpcConnection:
    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        *,
        name: str | None = None,
        reply_decoder: msgspec.msgpack.Decoder | None = None,
        hwm: int = 10000,
    ) -> None:
        self.endpoint = endpoint
        self.name = name or endpoint
        self.sock = zmq_socket(ctx, zmq.DEALER, hwm=hwm)
        self.sock.connect(endpoint)
        self._ids = itertools.count(1)
        self._decoder = reply_decoder

    def next_id(self) -> int:
        return next(self._ids)

    def request(
        self,
        header,
        payload: Sequence[codec.Frame] = (),
        timeout_s: float = 30.0,
        abort: Callable[[], bool] | None = None,
    ):
        """Send and wait for the matching reply. Returns (reply, payload frames). `abort` is
        asked every ABORT_CHECK_S while waiting: true raises RpcAborted (a stopping caller
        does not wait out a long time-out)."""
        deadline = time.monotonic() + timeout_s
        # A DEALER whose connection was refused (e.g. a CURVE handshake failed) has no pipe, and
        # a plain send would block forever: the send gets the request's timeout too.
        self.sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
        try:
            self.sock.send_multipart([b"", *codec.encode(header, payload)], copy=False)
        except zmq.Again:
            raise RpcTimeout(
                f"{self.name} at {self.endpoint}: {type(header).__name__} could not be sent within "
                f"{timeout_s:.1f}s (no connection)"
            ) from None
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise RpcTimeout(
                    f"{self.name} at {self.endpoint}: no reply to {type(header).__name__} "
                    f"within {timeout_s:.1f}s"
                )
            slice_ms = remaining_ms if abort is None else min(remaining_ms, int(ABORT_CHECK_S * 1000))
            if not self.sock.poll(slice_ms, zmq.POLLIN):
                if abort is not None and abort():
                    raise RpcAborted(f"{self.name} at {self.endpoint}: {type(header).__name__} abandoned")
                continue
            frames = self.sock.recv_multipart(copy=False)
            if frames and len(frames[0]) == 0:
                frames = frames[1:]
            if self._decoder is None:
                reply, out = codec.decode_reply(frames)
            else:
                reply, out = codec.decode_reply(frames, self._decoder)
            if reply.id != header.id:
                continue  # the late answer to an earlier, timed-out request
            if isinstance(reply, ErrorReply):
                raise RpcError(self.name, reply)
            return reply, out

    def close(self) -> None:
        self.sock.close(linger=0)


def split_envelope(frames: list[zmq.Frame]) -> tuple[list[bytes] | None, list[zmq.Frame]]:
    """ROUTER frames -> (identity [+ empty delimiter], body). REQ peers send the delimiter;
    DEALER peers may or may not."""
    if not frames:
        return None, []
    identity = frames[0].bytes
    if len(frames) >= 2 and len(frames[1]) == 0:
        return [identity, b""], frames[2:]
    return [identity], frames[1:]


def answer(
    body: Sequence[codec.Frame], decoder: msgspec.msgpack.Decoder, handle: Callable[[Any], Any], what: str
):
    """Decode a request of a protocol whose requests take no payload frames and return what
    `handle` makes of it; a bad request is an ErrorReply naming the field, and a bug in `handle`
    is logged and answered INTERNAL, so the server keeps serving. `what` names the server."""
    request_id = -1
    try:
        request, payload = codec.decode_request(body, decoder)
        request_id = request.id
        if payload:
            raise codec.ProtocolError("BAD_PAYLOAD", f"{what} requests take no payload frames")
        return handle(request)
    except codec.ProtocolError as e:
        return codec.error_reply(getattr(e, "request_id", request_id), e.code, e.message)
    except ValueError as e:
        return codec.error_reply(request_id, "BAD_HEADER", str(e))
    except Exception as e:  # noqa: BLE001 - a bug must not stop the server
        log.exception("%s server: internal error", what)
        return codec.error_reply(request_id, "INTERNAL", repr(e))
