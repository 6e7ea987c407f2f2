"""Pull the learner's current snapshot over ZeroMQ (a late joiner's first weights).

Socket rules: a DEALER connected to the learner's snapshot server (endpoint from the store key
`ws/transfer`), one per pull, closed with linger 0. Up to `transfer.window` CHUNK requests are
in flight; each reply is matched by id and copied straight into the destination tensor. No
reply waits longer than `transfer.timeout_s`. Every tensor's xxh3-64 is checked against the
manifest before the weights are returned: a pull gives verified weights or raises.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import zmq

from sluice.config.weight_sync import WeightTransferConfig
from sluice.net import zmq_socket
from sluice.weight_sync.layout import TORCH_DTYPES, checksum
from sluice.weight_sync.transfer_messages import (
    ChunkRange,
    ChunkReply,
    ChunkRequest,
    ManifestReply,
    ManifestRequest,
    ReleaseRequest,
    TensorEntry,
    reply_decoder,
)
from sluice.wire import codec
from sluice.wire.messages import PROTO_VERSION, ErrorReply


class TransferError(RuntimeError):
    """The pull failed (server error, timeout, lost lease, checksum mismatch)."""


@dataclass
class PulledWeights:
    version: int
    tensors: dict[str, torch.Tensor]
    nbytes: int
    seconds: float


def plan_chunks(entries: list[TensorEntry], chunk_bytes: int) -> Iterator[list[ChunkRange]]:
    """Requests of at most `chunk_bytes`: big tensors are split, small ones coalesced."""
    batch: list[ChunkRange] = []
    fill = 0
    for index, entry in enumerate(entries):
        start = 0
        while start < entry.nbytes:
            n = min(entry.nbytes - start, chunk_bytes - fill)
            batch.append(ChunkRange(index, start, n))
            fill += n
            start += n
            if fill == chunk_bytes:
                yield batch
                batch, fill = [], 0
    if batch:
        yield batch


class _Puller:
    def __init__(self, endpoint: str, cfg: WeightTransferConfig, ctx: zmq.Context, should_stop) -> None:
        self.cfg = cfg
        self.should_stop = should_stop
        self.sock = zmq_socket(ctx, zmq.DEALER, hwm=max(64, 4 * cfg.window))
        self.sock.connect(endpoint)
        self.endpoint = endpoint
        self._next_id = 0

    def send(self, header) -> int:
        self.sock.send_multipart([b"", *codec.encode(header)])
        return header.id

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def receive(self) -> tuple[object, list]:
        deadline = time.monotonic() + self.cfg.timeout_s
        while True:
            if self.should_stop():
                raise TransferError("stopped")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferError(f"{self.endpoint}: no reply within {self.cfg.timeout_s:.0f}s")
            if not self.sock.poll(int(min(remaining, 0.5) * 1000)):
                continue
            frames = self.sock.recv_multipart(copy=False)
            if frames and len(frames[0]) == 0:
                frames = frames[1:]
            try:
                reply, payload = codec.decode_reply(frames, reply_decoder)
            except codec.ProtocolError as e:
                raise TransferError(f"{self.endpoint}: bad reply: {e}") from None
            if isinstance(reply, ErrorReply):
                raise TransferError(f"{self.endpoint}: {reply.code}: {reply.message}")
            return reply, payload

    def close(self) -> None:
        self.sock.close(linger=0)


def pull_snapshot(
    endpoint: str,
    cfg: WeightTransferConfig,
    *,
    newer_than: int = -1,
    device: torch.device | str = "cpu",
    should_stop: Callable[[], bool] = lambda: False,
    ctx: zmq.Context | None = None,
) -> PulledWeights | None:
    """The learner's current version if it is newer than `newer_than`, else None."""
    t0 = time.perf_counter()
    puller = _Puller(endpoint, cfg, ctx or zmq.Context.instance(), should_stop)
    try:
        puller.send(ManifestRequest(proto=PROTO_VERSION, id=puller.new_id(), newer_than=newer_than))
        manifest, _ = puller.receive()
        if not isinstance(manifest, ManifestReply):
            raise TransferError(f"expected a MANIFEST reply, got {type(manifest).__name__}")
        if not manifest.lease:
            return None
        tensors = _receive_all(puller, manifest)
        puller.send(ReleaseRequest(proto=PROTO_VERSION, id=puller.new_id(), lease=manifest.lease))
        puller.receive()
    finally:
        puller.close()
    bad = [e.name for e in manifest.tensors if checksum(tensors[e.name]) != e.checksum]
    if bad:
        raise TransferError(
            f"version {manifest.version}: checksum mismatch in {len(bad)} tensors, e.g. {bad[:3]}"
        )
    nbytes = sum(e.nbytes for e in manifest.tensors)
    if torch.device(device).type != "cpu":
        tensors = {k: v.to(device) for k, v in tensors.items()}
    return PulledWeights(manifest.version, tensors, nbytes, time.perf_counter() - t0)


def _receive_all(puller: _Puller, manifest: ManifestReply) -> dict[str, torch.Tensor]:
    entries = manifest.tensors
    tensors = [torch.empty(e.shape, dtype=TORCH_DTYPES[e.dtype]) for e in entries]
    for e, t in zip(entries, tensors):
        if t.numel() * t.element_size() != e.nbytes:
            raise TransferError(
                f"manifest: tensor {e.name!r} {e.dtype}{e.shape} cannot hold {e.nbytes} bytes"
            )
    views = [t.reshape(-1).view(torch.uint8).numpy() for t in tensors]
    plan = plan_chunks(entries, manifest.chunk_bytes)
    pending: dict[int, list[ChunkRange]] = {}

    def ask() -> bool:
        ranges = next(plan, None)
        if ranges is None:
            return False
        req = ChunkRequest(proto=PROTO_VERSION, id=puller.new_id(), lease=manifest.lease, ranges=ranges)
        pending[puller.send(req)] = ranges
        return True

    while len(pending) < puller.cfg.window and ask():
        pass
    while pending:
        reply, payload = puller.receive()
        if not isinstance(reply, ChunkReply) or reply.id not in pending:
            continue  # a late answer to nothing we wait for
        ranges = pending.pop(reply.id)
        if len(payload) != len(ranges):
            raise TransferError(f"CHUNK reply {reply.id}: {len(payload)} frames for {len(ranges)} ranges")
        for r, frame in zip(ranges, payload):
            data = np.frombuffer(codec.frame_bytes(frame), dtype=np.uint8)
            if len(data) != r.nbytes:
                raise TransferError(f"CHUNK reply {reply.id}: {len(data)} bytes for a range of {r.nbytes}")
            views[r.index][r.start : r.start + r.nbytes] = data
        ask()
    return {e.name: t for e, t in zip(entries, tensors)}
