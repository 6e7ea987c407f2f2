"""Messages of the ZeroMQ chunked weight transfer (same framing as the buffer protocol: a
msgpack header frame, then raw payload frames). See docs/protocol.md, "Weight transfer".

A puller asks for the MANIFEST of the current snapshot (which pins it under a lease), then
requests byte ranges of its tensors with CHUNK (several in flight), verifies every tensor's
xxh3-64 against the manifest, and RELEASEs the lease.
"""

from __future__ import annotations

import msgspec

from sluice.wire.messages import ErrorReply


class _Request(msgspec.Struct, tag_field="op", forbid_unknown_fields=True):
    proto: int  # W: puller, PROTO_VERSION. R: server
    id: int  # W: puller. R: puller (matches replies to requests)


class ManifestRequest(_Request, tag="MANIFEST"):
    """Describe the current snapshot and lease it, unless it is not newer than `newer_than`."""

    newer_than: int = -1  # W: puller, the version it holds. R: server (no lease if not newer)


class ChunkRange(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    index: int  # tensor index in the manifest
    start: int  # first byte inside the tensor
    nbytes: int  # bytes from start (> 0)


class ChunkRequest(_Request, tag="CHUNK"):
    """Bytes of the leased snapshot: one payload frame per range, in order."""

    lease: str  # W: puller, from the manifest. R: server (UNKNOWN_LEASE if expired)
    ranges: list[ChunkRange]  # W: puller, at most the manifest's chunk_bytes in total


class ReleaseRequest(_Request, tag="RELEASE"):
    """The puller is done with the snapshot (it is freed once no lease holds it)."""

    lease: str


TransferRequest = ManifestRequest | ChunkRequest | ReleaseRequest


class TensorEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str  # parameter name
    dtype: str  # wire dtype (weight_sync.layout.TORCH_DTYPES key)
    shape: list[int]
    nbytes: int
    checksum: int  # xxh3-64 of the tensor's bytes


class _Reply(msgspec.Struct, tag_field="op", forbid_unknown_fields=True):
    proto: int
    id: int
    ok: bool = True


class ManifestReply(_Reply, tag="MANIFEST"):
    version: int = -1  # snapshot version; -1: nothing published yet
    lease: str = ""  # "": nothing to pull (none published, or not newer than newer_than)
    tensors: list[TensorEntry] = []
    chunk_bytes: int = 0  # most bytes one CHUNK request may ask for


class ChunkReply(_Reply, tag="CHUNK"):
    ranges: list[ChunkRange] = []  # echo of the request: payload frame i holds ranges[i]


class ReleaseReply(_Reply, tag="RELEASE"):
    pass


TransferReply = ManifestReply | ChunkReply | ReleaseReply | ErrorReply

request_decoder = msgspec.msgpack.Decoder(TransferRequest)
reply_decoder = msgspec.msgpack.Decoder(TransferReply)
