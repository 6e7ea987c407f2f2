"""Bucket layout, and the ZeroMQ chunked transfer late joiners pull the current version with."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch
import zmq
from helpers.lifetime import closing_all
from helpers.wire import RawPeer

from sluice.config.weight_sync import WeightTransferConfig
from sluice.weight_sync.layout import (
    TensorSpec,
    decode_checksums,
    empty_bucket,
    encode_checksums,
    pack_bucket,
    plan_buckets,
    slot_checksums,
    unpack_bucket,
)
from sluice.weight_sync.snapshot import Snapshot
from sluice.weight_sync.transfer_client import TransferError, plan_chunks, pull_snapshot
from sluice.weight_sync.transfer_messages import (
    ChunkRange,
    ChunkRequest,
    ManifestRequest,
    TensorEntry,
    reply_decoder,
)
from sluice.weight_sync.transfer_server import SnapshotServer
from sluice.wire.messages import PROTO_VERSION


def specs_of(model: torch.nn.Module) -> list[TensorSpec]:
    return [TensorSpec(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]


def test_bucket_plan_covers_every_parameter_once():
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 3))
    buckets = plan_buckets(specs_of(model), bucket_bytes=300)
    names = [s.name for b in buckets for s in b.slots]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    for b in buckets:  # slots tile the bucket without gaps or overlap
        end = 0
        for s in b.slots:
            assert s.offset == end
            end += s.numel
        assert end == b.numel
    assert len(buckets) > 2  # small buckets: several; a tensor bigger than one gets its own


def test_plan_groups_by_wire_dtype_and_casts_floats_only():
    specs = [
        TensorSpec("w", (4, 4), torch.float32),
        TensorSpec("steps", (3,), torch.int64),
        TensorSpec("b", (4,), torch.float32),
    ]
    buckets = plan_buckets(specs, bucket_bytes=1 << 20, cast_to=torch.bfloat16)
    assert {b.dtype: b.names for b in buckets} == {"bfloat16": ["w", "b"], "int64": ["steps"]}


def make_snapshot(version: int, model: torch.nn.Module, dtype=None, bucket_bytes=256) -> Snapshot:
    params = {n: p.detach() for n, p in model.named_parameters()}
    buckets = plan_buckets(specs_of(model), bucket_bytes, cast_to=dtype)
    flats = [pack_bucket(b, params, empty_bucket(b)) for b in buckets]
    return Snapshot(version, buckets, flats, [slot_checksums(b, f) for b, f in zip(buckets, flats)])


def test_pack_casts_on_the_fly_and_unpacks_views():
    model = torch.nn.Linear(7, 5)
    snap = make_snapshot(1, model, dtype=torch.bfloat16)
    got = dict(unpack_bucket(snap.buckets[0], snap.flats[0]))
    for n, p in model.named_parameters():
        assert torch.equal(got[n], p.detach().to(torch.bfloat16))
    assert decode_checksums(encode_checksums(snap.sums[0])) == snap.sums[0]


def test_chunk_plan_covers_every_byte_once_within_the_limit():
    entries = [TensorEntry(f"t{i}", "uint8", [n], n, 0) for i, n in enumerate([5, 0, 23, 1, 64, 3])]
    requests = list(plan_chunks(entries, chunk_bytes=10))
    assert all(sum(r.nbytes for r in req) <= 10 for req in requests)
    covered = {i: [] for i in range(len(entries))}
    for req in requests:
        for r in req:
            covered[r.index].append((r.start, r.nbytes))
    for i, e in enumerate(entries):
        pos = 0
        for start, n in sorted(covered[i]):
            assert start == pos and n > 0
            pos += n
        assert pos == e.nbytes


@pytest.fixture
def server():
    """`make(**transfer settings)`: a started SnapshotServer on a free port; closed at teardown."""

    def make(**overrides) -> SnapshotServer:
        cfg = WeightTransferConfig(**{"chunk_mb": 0.0005, "window": 3, "timeout_s": 10, **overrides})
        s = SnapshotServer(cfg, "127.0.0.1", ctx=zmq.Context())
        s.start()
        return s

    with closing_all(make) as factory:
        yield factory


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_pull_gives_identical_weights(server, dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(40, 16), torch.nn.Linear(16, 9), torch.nn.LayerNorm(9))
    srv = server()
    assert pull_snapshot(srv.endpoint, srv.cfg) is None  # nothing published yet
    snap = make_snapshot(7, model, dtype)
    srv.publish(snap)
    pulled = pull_snapshot(srv.endpoint, srv.cfg)  # 512-byte chunks: split and coalesced
    assert pulled.version == 7 and pulled.nbytes == snap.nbytes
    for n, p in model.named_parameters():
        want = p.detach().to(dtype or p.dtype)
        assert pulled.tensors[n].dtype == want.dtype and torch.equal(pulled.tensors[n], want), n
    assert pull_snapshot(srv.endpoint, srv.cfg, newer_than=7) is None
    assert srv.pulls_served == 1 and srv.bytes_served == snap.nbytes


def test_pull_refuses_bytes_that_do_not_match_the_manifest(server):
    model = torch.nn.Linear(8, 8)
    snap = make_snapshot(3, model, bucket_bytes=4096)
    snap.sums[0][1] ^= 1  # the snapshot's checksum disagrees with its bytes
    srv = server()
    srv.publish(Snapshot(3, snap.buckets, snap.flats, snap.sums))
    with pytest.raises(TransferError, match="checksum mismatch in 1 tensors"):
        pull_snapshot(srv.endpoint, srv.cfg)


def request(peer: RawPeer, header, frames_out=False):
    """One request; its typed reply (and, with `frames_out`, the frames after it)."""
    frames = peer.exchange([msgspec.msgpack.encode(header)])
    assert frames is not None, f"no reply to {header}"
    reply = reply_decoder.decode(frames[0])
    return (reply, frames[1:]) if frames_out else reply


def test_lease_pins_the_snapshot_and_bad_requests_get_named_errors(server, zmq_ctx):
    model = torch.nn.Linear(4, 4)
    srv = server(lease_s=0.5)
    srv.publish(make_snapshot(1, model))
    peer = RawPeer(zmq_ctx, srv.endpoint)
    manifest = request(peer, ManifestRequest(proto=PROTO_VERSION, id=1))
    leased = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    srv.publish(make_snapshot(2, model))  # a newer version does not change the leased bytes
    reply, frames = request(
        peer,
        ChunkRequest(proto=PROTO_VERSION, id=2, lease=manifest.lease, ranges=[ChunkRange(0, 0, 64)]),
        frames_out=True,
    )
    assert reply.ok and len(frames) == 1
    first = torch.frombuffer(bytearray(frames[0]), dtype=torch.float32).view(4, 4)
    assert torch.equal(first, leased)
    bad = request(
        peer, ChunkRequest(proto=PROTO_VERSION, id=3, lease=manifest.lease, ranges=[ChunkRange(0, 60, 8)])
    )
    assert bad.code == "BAD_HEADER" and "ranges[0]" in bad.message
    bad = request(
        peer, ChunkRequest(proto=PROTO_VERSION, id=4, lease=manifest.lease, ranges=[ChunkRange(0, 0, 4096)])
    )
    assert bad.code == "TOO_LARGE"
    garbage = peer.exchange([b"\xc1not msgpack"])
    assert garbage is not None and reply_decoder.decode(garbage[0]).code == "BAD_FRAME"
    time.sleep(0.8)  # the lease (0.5 s) idles out: what is tested
    gone = request(
        peer, ChunkRequest(proto=PROTO_VERSION, id=5, lease=manifest.lease, ranges=[ChunkRange(0, 0, 4)])
    )
    assert gone.code == "UNKNOWN_LEASE"
    assert pull_snapshot(srv.endpoint, srv.cfg).version == 2  # still serving
    peer.close()


def test_buffer_pool_reuses_a_buffer_only_when_no_view_of_it_is_alive():
    from sluice.weight_sync.buffers import BufferPool, only_owner

    bucket = plan_buckets([TensorSpec("w", (64,), torch.float32)], 1 << 20)[0]
    pool = BufferPool(torch.device("cpu"))
    first = pool.get(bucket)
    view = first[:8].view(2, 4)  # what a receiver hands the rollout loop
    assert not only_owner(first)
    pool.retire([first])
    second = pool.get(bucket)
    assert second is not first  # the view is alive: a fresh buffer
    del view
    assert only_owner(first)
    assert pool.get(bucket) is first and pool.reused == 1 and pool.allocated == 2
