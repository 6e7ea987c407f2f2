"""Serves the current snapshot to late joiners over ZeroMQ, in a thread of learner rank 0.

Socket rules: binds a ROUTER on `tcp://<master_addr>:<transfer.port>` (port 0: a free port;
the endpoint is advertised under `ws/transfer` in the rendezvous store). Pullers connect a
DEALER. Request/reply; a puller keeps up to `transfer.window` CHUNK requests in flight, which is
the flow control (credit-based: the server never sends what was not asked for). Chunks are
sent zero-copy from the snapshot's host buffers. A MANIFEST pins the snapshot it describes
under a lease, so publishing newer versions meanwhile never changes the bytes under a pull;
a lease idle for `transfer.lease_s` is dropped (UNKNOWN_LEASE: the puller starts over). Bad
requests get an ErrorReply naming the field, and the server keeps serving.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import zmq

from sluice.config.weight_sync import WeightTransferConfig
from sluice.net import zmq_socket
from sluice.rpc import answer, split_envelope
from sluice.weight_sync.layout import tensor_bytes
from sluice.weight_sync.snapshot import Snapshot, SnapshotTensor
from sluice.weight_sync.transfer_messages import (
    ChunkReply,
    ChunkRequest,
    ManifestReply,
    ManifestRequest,
    ReleaseReply,
    TensorEntry,
    request_decoder,
)
from sluice.wire import codec
from sluice.wire.messages import PROTO_VERSION, ErrorReply

log = logging.getLogger(__name__)


class _Lease:
    def __init__(self, snapshot: Snapshot, now: float) -> None:
        self.snapshot = snapshot
        self.tensors: list[SnapshotTensor] = list(snapshot.tensors())
        self.last_used = now


class SnapshotServer:
    def __init__(self, cfg: WeightTransferConfig, host: str, *, ctx: zmq.Context | None = None) -> None:
        self.cfg = cfg
        self.chunk_bytes = int(cfg.chunk_mb * 2**20)
        self._ctx = ctx or zmq.Context.instance()
        self.sock = zmq_socket(self._ctx, zmq.ROUTER, hwm=max(64, 4 * cfg.window))
        if cfg.port:
            self.sock.bind(f"tcp://{host}:{cfg.port}")
            port = cfg.port
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._lock = threading.Lock()
        self._current: Snapshot | None = None
        self._leases: dict[str, _Lease] = {}
        self.pulls_served = 0  # manifests that leased a snapshot
        self.bytes_served = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="weight-transfer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def publish(self, snapshot: Snapshot) -> None:
        """The snapshot new pulls get (pulls in progress keep theirs)."""
        with self._lock:
            self._current = snapshot

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        else:
            self.sock.close(linger=0)

    # -- thread --------------------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                self._expire(time.monotonic())
                if not self.sock.poll(100):
                    continue
                frames = self.sock.recv_multipart(copy=False)
                envelope, body = split_envelope(frames)
                if envelope is None:
                    continue
                reply, payload = self._handle(body)
                self.sock.send_multipart([*envelope, *codec.encode(reply, payload)], copy=False)
        finally:
            self.sock.close(linger=0)

    def _expire(self, now: float) -> None:
        for lease_id in [k for k, v in self._leases.items() if now - v.last_used > self.cfg.lease_s]:
            log.info("weight transfer: lease %s idle for %.0fs, dropped", lease_id, self.cfg.lease_s)
            del self._leases[lease_id]

    def _handle(self, body):
        out = answer(body, request_decoder, self._dispatch, "weight-transfer")
        return (out, []) if isinstance(out, ErrorReply) else out

    def _dispatch(self, req):
        p = PROTO_VERSION
        if isinstance(req, ManifestRequest):
            with self._lock:
                snapshot = self._current
            if snapshot is None or snapshot.version <= req.newer_than:
                version = -1 if snapshot is None else snapshot.version
                return ManifestReply(proto=p, id=req.id, version=version), []
            lease_id = uuid.uuid4().hex
            lease = _Lease(snapshot, time.monotonic())
            self._leases[lease_id] = lease
            self.pulls_served += 1
            entries = [
                TensorEntry(t.name, t.dtype, t.shape, t.data.numel() * t.data.element_size(), t.checksum)
                for t in lease.tensors
            ]
            reply = ManifestReply(
                proto=p,
                id=req.id,
                version=snapshot.version,
                lease=lease_id,
                tensors=entries,
                chunk_bytes=self.chunk_bytes,
            )
            return reply, []
        if isinstance(req, ChunkRequest):
            lease = self._lease(req.lease)
            frames = self._chunk(lease, req)
            lease.last_used = time.monotonic()
            self.bytes_served += sum(len(f) for f in frames)
            return ChunkReply(proto=p, id=req.id, ranges=req.ranges), frames
        lease_id = req.lease
        self._lease(lease_id)
        del self._leases[lease_id]
        return ReleaseReply(proto=p, id=req.id), []

    def _lease(self, lease_id: str) -> _Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise codec.ProtocolError("UNKNOWN_LEASE", f"lease {lease_id!r} expired or never existed")
        return lease

    def _chunk(self, lease: _Lease, req: ChunkRequest) -> list[memoryview]:
        total = sum(r.nbytes for r in req.ranges)
        if total > self.chunk_bytes:
            raise codec.ProtocolError(
                "TOO_LARGE", f"ranges ask for {total} bytes, at most {self.chunk_bytes}"
            )
        frames = []
        for k, r in enumerate(req.ranges):
            if not 0 <= r.index < len(lease.tensors):
                raise codec.ProtocolError(
                    "BAD_HEADER",
                    f"ranges[{k}].index={r.index}: the manifest has {len(lease.tensors)} tensors",
                )
            data = tensor_bytes(lease.tensors[r.index].data)
            if r.start < 0 or r.nbytes <= 0 or r.start + r.nbytes > len(data):
                raise codec.ProtocolError(
                    "BAD_HEADER",
                    f"ranges[{k}]: bytes [{r.start}, {r.start + r.nbytes}) outside tensor "
                    f"{lease.tensors[r.index].name!r} of {len(data)} bytes",
                )
            frames.append(data[r.start : r.start + r.nbytes])
        return frames
