"""Encode and decode Sluice messages: a msgpack header frame plus raw array frames.

Arrays are never encoded element by element: each travels as its own frame (sent with
`copy=False`), and is read back with `numpy.frombuffer` (zero copy, read-only view).
Decoding never raises anything but `ProtocolError`, which carries the error code and a
message naming the bad field or frame, ready to become an `ErrorReply`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec
import numpy as np

from sluice.wire.messages import (
    PROTO_VERSION,
    ArraySpec,
    ErrorReply,
    Reply,
    Request,
    TrajectoryMeta,
)

# Accepted dtype names and their item sizes. bfloat16 has no numpy dtype: it travels as raw
# 2-byte words and is viewed with torch on the receiving side.
DTYPES: dict[str, int] = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
}

Frame = Any  # bytes, memoryview or zmq.Frame: anything exposing the buffer protocol
M = TypeVar("M", bound=msgspec.Struct)

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


class ProtocolError(Exception):
    """A message that cannot be accepted. `code` is one of messages.ErrorCode."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def frame_bytes(frame: Frame) -> memoryview:
    """A memoryview over a frame's bytes without copying (zmq.Frame exposes `.buffer`)."""
    buf = getattr(frame, "buffer", frame)
    return memoryview(buf).cast("B")


def encode(header: msgspec.Struct, payload: Sequence[Frame] = ()) -> list[Frame]:
    """Header frame followed by payload frames, ready for `send_multipart(copy=False)`."""
    return [_encoder.encode(header), *payload]


# What the wire calls each value msgpack can hold (for a message naming what a frame held).
_MSGPACK_TYPES = {
    type(None): "nil",
    bool: "bool",
    int: "int",
    float: "float",
    str: "str",
    bytes: "bin",
    list: "array",
}


def decode_request(
    frames: Sequence[Frame], decoder: msgspec.msgpack.Decoder = _request_decoder
) -> tuple[Request, list[Frame]]:
    """Parse a request: (header, payload frames). Raises ProtocolError with the request id set
    on `.request_id` where one could be read. `decoder` selects the protocol (buffer requests
    by default; the control plane passes its own). The codes follow docs/protocol.md, Errors:
    a header frame that is not exactly one msgpack map is BAD_FRAME; a map whose `proto` is an
    int other than ours is PROTO_VERSION whatever else it holds (another version may have other
    ops and keys); any other map that does not fit the schema is BAD_HEADER."""
    if not frames:
        raise _with_id(ProtocolError("BAD_FRAME", "empty message: expected a header frame"), -1)
    raw = frame_bytes(frames[0])
    try:
        header = decoder.decode(raw)
    except msgspec.ValidationError as e:  # (a DecodeError too: caught first)
        raise _refused_header(raw, e) from None
    except (msgspec.DecodeError, RecursionError) as e:
        raise _with_id(ProtocolError("BAD_FRAME", f"the header frame is not msgpack: {e}"), -1) from None
    if header.proto != PROTO_VERSION:
        raise _with_id(_proto_error(header.proto), header.id)
    return header, list(frames[1:])


def _refused_header(raw: memoryview, error: msgspec.ValidationError) -> ProtocolError:
    """Why a header the schema refused is refused. The typed decoder stops at the first thing
    it does not expect, before it has read the whole frame, so it cannot tell random bytes from
    a bad map: decoding the frame again untyped (only on this error path) can."""
    try:
        loose = msgspec.msgpack.decode(raw)
    except (msgspec.DecodeError, RecursionError) as e:
        return _with_id(ProtocolError("BAD_FRAME", f"the header frame is not msgpack: {e}"), -1)
    if not isinstance(loose, dict):
        kind = _MSGPACK_TYPES.get(type(loose), "ext")
        return _with_id(ProtocolError("BAD_FRAME", f"the header frame is a msgpack {kind}, not a map"), -1)
    request_id = loose.get("id")
    request_id = request_id if type(request_id) is int else -1  # (bool is an int in Python)
    proto = loose.get("proto")
    if type(proto) is int and proto != PROTO_VERSION:
        return _with_id(_proto_error(proto), request_id)
    return _with_id(ProtocolError("BAD_HEADER", f"header: {error}"), request_id)


def _proto_error(proto: int) -> ProtocolError:
    return ProtocolError("PROTO_VERSION", f"header.proto={proto}, this server speaks {PROTO_VERSION}")


def decode_reply(
    frames: Sequence[Frame], decoder: msgspec.msgpack.Decoder = _reply_decoder
) -> tuple[Reply, list[Frame]]:
    """Parse a reply. A client treats a malformed reply as a broken server: ProtocolError."""
    if not frames:
        raise ProtocolError("BAD_FRAME", "empty reply")
    try:
        header = decoder.decode(frame_bytes(frames[0]))
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ProtocolError("BAD_HEADER", f"reply header: {e}") from None
    return header, list(frames[1:])


def _with_id(err: ProtocolError, request_id: int) -> ProtocolError:
    err.request_id = request_id  # type: ignore[attr-defined]
    return err


def error_reply(request_id: int, code: str, message: str, retry_after_ms: int = 0) -> ErrorReply:
    return ErrorReply(
        proto=PROTO_VERSION,
        id=request_id,
        code=code,
        message=message,
        retry_after_ms=retry_after_ms,
    )


# ---------------------------------------------------------------------------------------------
# Arrays


# numpy dtype <-> wire name, looked up per array on hot paths (str(dtype) costs microseconds).
_NUMPY_DTYPES = {name: np.dtype(np.uint16 if name == "bfloat16" else name) for name in DTYPES}
_WIRE_NAMES = {np.dtype(name): name for name in DTYPES if name != "bfloat16"}


def array_spec(name: str, array: np.ndarray) -> ArraySpec:
    dtype = _WIRE_NAMES.get(array.dtype.newbyteorder("=") if array.dtype.byteorder == ">" else array.dtype)
    if dtype is None:
        raise ValueError(f"array {name!r}: dtype {array.dtype} is not one of {sorted(DTYPES)}")
    return ArraySpec(name=name, dtype=dtype, shape=list(array.shape))


def array_payload(array: np.ndarray) -> memoryview:
    """The bytes of an array as one frame (little-endian, C order; copies only if needed)."""
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    if array.ndim == 1 and array.flags.c_contiguous:
        return array.data.cast("B")
    return np.ascontiguousarray(array).reshape(-1).data.cast("B")


def spec_sizes(specs: Sequence[ArraySpec], where: str) -> list[int]:
    """Validate dtypes and shapes; return each array's payload bytes, in order. On the hot path
    of every PUT and GET (a batch's every array): C-level calls only, no generator per spec."""
    sizes = []
    for j, spec in enumerate(specs):
        itemsize = DTYPES.get(spec.dtype)
        if itemsize is None:
            raise ProtocolError(
                "BAD_HEADER",
                f"{where}.arrays[{j}].dtype={spec.dtype!r} is not one of {sorted(DTYPES)}",
            )
        if spec.shape and min(spec.shape) < 0:
            raise ProtocolError("BAD_HEADER", f"{where}.arrays[{j}].shape={spec.shape} is negative")
        sizes.append(math.prod(spec.shape) * itemsize)
    return sizes


def check_specs(specs: Sequence[ArraySpec], where: str) -> int:
    """Validate dtypes and shapes; return the total payload bytes they announce."""
    return sum(spec_sizes(specs, where))


def split_payload(trajs: Sequence[TrajectoryMeta], payload: Sequence[Frame]) -> list[list[Frame]]:
    """Assign payload frames to trajectories, checking count and length of every frame."""
    expected = sum(len(t.arrays) for t in trajs)
    if len(payload) != expected:
        raise ProtocolError(
            "BAD_PAYLOAD",
            f"header announces {expected} array frames, message carries {len(payload)}",
        )
    out: list[list[Frame]] = []
    k = 0
    for i, traj in enumerate(trajs):
        frames_i = []
        for j, want in enumerate(spec_sizes(traj.arrays, f"trajs[{i}]")):
            got = len(frame_bytes(payload[k]))
            if got != want:
                spec = traj.arrays[j]
                raise ProtocolError(
                    "BAD_PAYLOAD",
                    f"frame {k + 1} (trajs[{i}].arrays[{j}] {spec.name!r}): {got} bytes, "
                    f"{spec.dtype}{spec.shape} needs {want}",
                )
            frames_i.append(payload[k])
            k += 1
        out.append(frames_i)
    return out


def view_array(spec: ArraySpec, frame: Frame) -> np.ndarray:
    """A read-only numpy view of a payload frame. bfloat16 comes back as uint16 words."""
    array = np.frombuffer(frame_bytes(frame), dtype=_NUMPY_DTYPES[spec.dtype])
    return array if len(spec.shape) == 1 else array.reshape(spec.shape)


def view_arrays(specs: Sequence[ArraySpec], data: memoryview) -> dict[str, np.ndarray]:
    """Views of arrays laid out back to back in `data` in the order of `specs` (sizes checked by
    `spec_sizes`, `data` at least their sum): a trajectory's arrays in a segment file. One
    numpy call per 1-D array, no slice of `data` per array."""
    arrays, at = {}, 0
    for spec in specs:
        dtype = _NUMPY_DTYPES[spec.dtype]
        count = math.prod(spec.shape)
        array = np.frombuffer(data, dtype=dtype, count=count, offset=at)
        arrays[spec.name] = array if len(spec.shape) == 1 else array.reshape(spec.shape)
        at += count * dtype.itemsize
    return arrays
