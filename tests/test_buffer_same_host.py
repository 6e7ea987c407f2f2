"""The same-host data plane: shared segment files instead of payload frames.

Bit-identical delivery both ways, mixed transports, the fallback to ZeroMQ when the same-host
check fails, producers that die while writing or write garbage, and segment files that are
not reused while a lease (or a recent SAMPLE) may still read them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.groups import byte_of, group_of, make_group
from helpers.wait import wait_until

from sluice.buffer import same_host
from sluice.buffer.client import BufferClient, BufferError
from sluice.buffer.link import Call, wait_all
from sluice.buffer.log_records import REGION_ALIGN, region_layout
from sluice.buffer.same_host import RegionPayload
from sluice.buffer.segment_log import SegmentLog, Snapshot
from sluice.buffer.view_pins import ViewPins
from sluice.config.buffer import BufferConfig
from sluice.trajectory import Trajectory
from sluice.wire.messages import PROTO_VERSION, PutRequest, ReserveRequest

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ["bool", "int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64"]


def rich_group(gid: str, size: int, seed: int, version: int = 0) -> list[Trajectory]:
    """Trajectories with arrays of every dtype, odd lengths, several dims, empty ones, and
    arbitrary bit patterns (NaNs included) in the float arrays."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(size):
        arrays = {}
        for k, dtype in enumerate(DTYPES):
            n = int(rng.integers(0, 3000))
            raw = rng.integers(0, 256, n * np.dtype(dtype).itemsize, dtype=np.uint8)
            arrays[f"a{k}"] = raw.view(dtype) if dtype != "bool" else raw.astype(bool)
        arrays["cube"] = rng.standard_normal((3, 4, 5)).astype(np.float32)
        arrays["empty"] = np.zeros((0, 7), dtype=np.int32)
        out.append(arrays)
    return group_of(gid, out, version, info=True)


def big_group(gid: str, nbytes: int = 16 << 10, size: int = 1, fill: int | None = None) -> list[Trajectory]:
    """One byte value throughout (`fill`, default a function of the group id)."""
    fill = byte_of(gid) if fill is None else fill % 251
    return make_group(gid, size, nbytes=nbytes, dtype=np.uint8, fill=fill)


def assert_identical(got: list[Trajectory], sent: list[Trajectory], every: bool = True) -> None:
    """Each received trajectory equals the one sent with its id, bit for bit (and, `every`,
    each sent one was received once)."""
    by_id = {t.traj_id: t for t in sent}
    if every:
        assert sorted(t.traj_id for t in got) == sorted(by_id)
    for t in got:
        want = by_id[t.traj_id]
        assert (t.group_id, t.version, t.reward, t.info) == (
            want.group_id,
            want.version,
            want.reward,
            want.info,
        )
        assert list(t.arrays) == list(want.arrays)
        for name, a in t.arrays.items():
            b = want.arrays[name]
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert a.tobytes() == b.tobytes(), name  # bit for bit (NaN payloads too)


@pytest.fixture(params=["ephemeral", "durable"])
def log_dir(request, tmp_path) -> Path | None:
    """Where shards keep their segments: memory (no log) or a durable log."""
    return tmp_path / "log" if request.param == "durable" else None


def test_delivery_through_shared_memory_is_bit_identical(shard_factory, log_dir):
    shards = [shard_factory(log_dir=log_dir and log_dir / str(k)) for k in range(2)]
    eps = [s.endpoint for s in shards]
    sent = [t for i in range(6) for t in rich_group(f"g{i}", size=3, seed=i)]
    with BufferClient(eps, timeout_s=10) as producer, BufferClient(eps, timeout_s=10) as consumer:
        assert producer.ping(timeout_s=10) and consumer.ping(timeout_s=10)
        assert all(link.peer is not None for link in producer.links + consumer.links)
        assert producer.put(sent).accepted == 18
        assert producer.shared_put_bytes == sum(t.nbytes for t in sent)  # no payload frame sent
        batch = consumer.get(100)
        assert consumer.shared_get_trajs == 18  # every trajectory read from the shard's files
        assert_identical(batch.trajs, sent)
        assert not any(a.flags.writeable for t in batch.trajs for a in t.arrays.values())  # read-only maps
        assert consumer.ack(batch) == 18
        stats = [r.stats for r in consumer.stats()]
        assert sum(s["region_puts"] for s in stats) >= 2 and sum(s["refs_served"] for s in stats) == 18
        assert all(s["reservations"] == 1 and s["held"] == 0 for s in stats)  # each: the next PUT's
        producer.close()  # gives those back
        assert all(r.stats["reservations"] == 0 for r in consumer.stats())
        assert all(r.stats["reservations_expired"] == 0 for r in consumer.stats())


def test_a_producer_needs_one_reservation_round_trip_not_one_per_put(shard_factory, log_dir):
    """Each same-host PUT asks for the region of the next one (`reserve_next`): a steady
    producer sends RESERVE once, then PUTs straight into the space its shard set aside."""
    shard = shard_factory(log_dir=log_dir)
    sent = [big_group(f"g{i}", nbytes=1 << 16)[0] for i in range(10)]
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        assert client.ping()
        for t in sent:
            assert client.put([t]).accepted == 1
        assert client.reserve_requests == 1 and client.shared_put_bytes == 10 << 16
        sent.append(big_group("larger", nbytes=1 << 17)[0])
        client.put(sent[-1:])  # does not fit the spare: RESERVE
        assert client.reserve_requests == 2
        assert client.stats()[0].stats["reservations"] == 1  # (the smaller spare was released)
        batch = client.get(100)
        assert_identical(batch.trajs, sent)
        client.ack(batch)


def test_a_same_host_pipeline_reserves_once_and_keeps_one_spare_per_put_in_flight(shard_factory, tmp_path):
    """Each same-host PUT brings the region of a PUT one window later: after the first
    `window` PUTs, none waits for a RESERVE (segment rolls aside), and no region is copied."""
    shard = shard_factory(log_dir=tmp_path / "log", segment_bytes=8 << 20)
    sent = [big_group(f"s{i}", nbytes=64 << 10)[0] for i in range(40)]
    with BufferClient([shard.endpoint], timeout_s=10) as producer:
        assert producer.ping()
        with producer.pipeline(window=2) as pipe:
            for t in sent:
                pipe.put([t])
        assert producer.shared_put_bytes == 40 * (64 << 10)
        assert producer.reserve_requests <= 3
        stats = producer.stats()[0].stats
        assert stats["region_copies"] == 0 and stats["region_puts"] == 40
    with BufferClient([shard.endpoint], timeout_s=10) as consumer:
        batch = consumer.get(100)
        assert_identical(batch.trajs, sent)
        consumer.ack(batch)
        assert consumer.stats()[0].stats["reservations"] == 0  # the producer gave its spares back


def test_mixed_transports_interoperate(shard_factory, log_dir):
    """A ZeroMQ producer with a same-host consumer and the other way round."""
    shard = shard_factory(log_dir=log_dir)
    a, b = rich_group("a", 2, seed=1), rich_group("b", 2, seed=2)
    with (
        BufferClient([shard.endpoint], timeout_s=10, same_host="zmq") as remote,
        BufferClient([shard.endpoint], timeout_s=10) as local,
    ):
        assert remote.ping() and local.ping()
        assert remote.links[0].peer is None and local.links[0].peer is not None
        remote.put(a)
        local.put(b)
        assert remote.shared_put_bytes == 0 and local.shared_put_bytes > 0
        got = local.get(100)
        assert_identical(got.trajs, a + b)
        # a durable log holds ZeroMQ PUTs too: those are read from the files as well
        assert local.shared_get_trajs == (4 if log_dir else 2)
        local.nack(got)
        again = remote.get(100)
        assert_identical(again.trajs, a + b)
        assert remote.ack(again) == 4


def test_falls_back_to_zeromq_when_the_same_host_check_fails(shard_factory, monkeypatch):
    shard = shard_factory()
    sent = big_group("g", size=2)
    # another kernel (boot id): remote
    monkeypatch.setattr(same_host, "host_id", lambda: "another-host")
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        assert client.ping() and client.links[0].peer is None
        client.put(sent)
        batch = client.get(10)
        assert_identical(batch.trajs, sent)
        client.ack(batch)
        assert client.shared_put_bytes == 0 and client.shared_get_trajs == 0
    monkeypatch.undo()
    # the token file is not readable here (another machine's path, another user): ZeroMQ
    token_file = shard.server.log.shared_dir / same_host.TOKEN_FILE
    token = token_file.read_text()
    token_file.unlink()
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        assert client.ping() and client.links[0].peer is None
        client.put(big_group("h"))
        assert client.shared_put_bytes == 0 and len(client.get(10).trajs) == 1
    # a file that is not this shard's token (a same-named directory elsewhere): refused by the
    # shard, then the client asks again and, refused each time, stays on ZeroMQ
    token_file.write_text("not-the-token")
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        assert client.ping() and client.links[0].peer is not None
        for i in range(4):
            client.put(big_group(f"w{i}"))  # RESERVE refused: sent as frames instead
            client.ping()
        assert client.shared_put_bytes == 0 and client.links[0].peer is None
        assert client.stats()[0].stats["put"] == 2 + 1 + 4  # every PUT stored
    token_file.write_text(token)
    with BufferClient([shard.endpoint], timeout_s=10) as client:  # the real token works again
        assert client.ping()
        client.put(big_group("ok"))
        assert client.shared_put_bytes > 0


def test_a_restarted_shard_is_noticed_and_shared_again(shard_factory, tmp_path):
    shard = shard_factory(log_dir=tmp_path / "log", fsync="none")
    sent = [big_group(f"g{i}")[0] for i in range(4)]
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        assert client.ping()
        client.put(sent[:2])
        old_token = client.links[0].peer.token
        shard.restart()  # new process state, new token, same directory
        client.put(sent[2:])  # the lost connection made the client ask HELLO again
        batch = client.get(100, wait_ms=5000)
        assert_identical(batch.trajs, sent)
        assert client.links[0].peer.token != old_token and client.shared_get_trajs == 4
        assert client.ack(batch) == 4


# -- producers that die or lie ----------------------------------------------------------------


def _reserve(client: BufferClient, nbytes: int):
    link = client.links[0]
    call = Call(
        ReserveRequest(proto=PROTO_VERSION, id=link.next_id(), nbytes=nbytes, token=link.peer.token),
        timeout_s=10,
    )
    link.send(call)
    wait_all([call], client.links)
    assert call.error is None, call.error
    return call.reply


KILLED_PRODUCER = """
import os, signal, sys
import numpy as np
from sluice.buffer.client import BufferClient
from sluice.buffer.link import Call, wait_all
from sluice.wire.messages import PROTO_VERSION, ReserveRequest
client = BufferClient([sys.argv[1]], timeout_s=10)
assert client.ping(timeout_s=10) and client.links[0].peer is not None
link = client.links[0]
reserve = ReserveRequest(proto=PROTO_VERSION, id=link.next_id(), nbytes=1 << 16, token=link.peer.token)
call = Call(reserve, timeout_s=10)
link.send(call)
wait_all([call], client.links)
fd = os.open(link.peer.maps.path(call.reply.segment), os.O_WRONLY)
os.pwrite(fd, np.full(1 << 15, 7, dtype=np.uint8).tobytes(), call.reply.offset)  # half of it
print("wrote half", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_producer_killed_mid_write_never_yields_a_corrupt_trajectory(shard_factory, tmp_path):
    log_dir = tmp_path / "log"
    shard = shard_factory(log_dir=log_dir, fsync="none", reserve_timeout_s=0.5)
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_PRODUCER, shard.endpoint],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9 and "wrote half" in proc.stdout, proc.stderr[-2000:]
    good = [big_group(f"g{i}", nbytes=1 << 15)[0] for i in range(3)]
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        assert client.ping()
        stats = client.stats()[0].stats
        assert stats["reservations"] == 1 and stats["held"] == 0  # reserved, never stored
        client.put(good)
        wait_until(
            lambda: client.stats()[0].stats["reservations_expired"] >= 1,
            10,
            "the dead producer's reservation expired",
        )
        segment = shard.server.log.active
        assert segment in shard.server.log.tainted  # its file will be deleted, never reused
        batch = client.get(100)
        assert_identical(batch.trajs, good)
        client.nack(batch)
    shard.restart()  # recovery reads past the half-written region, and taints its segment again
    assert segment in shard.server.log.tainted
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        batch = client.get(100, wait_ms=5000)
        assert_identical(batch.trajs, good)
        assert client.ack(batch) == 3


def test_a_put_whose_region_does_not_hold_what_it_claims_stores_nothing(shard_factory):
    shard = shard_factory()
    traj = big_group("g", nbytes=1 << 16, fill=7)[0]  # never the garbage's zeros
    meta, frames = traj.to_wire()
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        assert client.ping()
        link = client.links[0]
        nbytes = region_layout([traj.nbytes])[1]
        res = _reserve(client, nbytes)
        assert res.offset % REGION_ALIGN == 0
        intended = RegionPayload([(meta, frames)]).checksum
        garbage = np.zeros(traj.nbytes, dtype=np.uint8)
        link.peer.write(res.segment, res.offset, RegionPayload([(meta, [memoryview(garbage)])]))

        def put_region() -> Call:  # a PUT naming the region, with the checksum of `frames`
            call = Call(
                PutRequest(
                    proto=PROTO_VERSION,
                    id=link.next_id(),
                    trajs=[meta],
                    region=res.region,
                    region_checksum=intended,
                ),
                timeout_s=10,
            )
            link.send(call)
            wait_all([call], client.links)
            return call

        call = put_region()
        assert isinstance(call.error, BufferError) and call.error.code == "BAD_PAYLOAD"
        assert "region_checksum" in call.error.message
        # the region is used up: naming it again is refused too
        call = put_region()
        assert call.error.code == "BAD_PAYLOAD" and "not reserved" in call.error.message
        assert client.stats()[0].stats["held"] == 0 and client.get(10).trajs == []
        client.put([traj])  # the ordinary way still works
        assert_identical(client.get(10).trajs, [traj])


def test_an_abandoned_reservation_leaves_a_deleted_file_to_late_writers(tmp_path):
    """A producer stalled past reserve_timeout_s may still write into its region some day: the
    segment is deleted when retired, never reused, so that write lands in no live file."""
    cfg = BufferConfig(fsync="none", reserve_timeout_s=0.1, segment_bytes=1 << 16, compact_min_bytes=1 << 16)
    log = SegmentLog(tmp_path, cfg)
    log.recover()
    res = log.reserve(4096, b"producer", now=0.0)
    zombie = os.open(log.maps.path(res.segment), os.O_WRONLY)
    try:
        log.tick(1.0, 0, None)  # expired
        assert res.segment in log.tainted and log.counters["reservations_expired"] == 1
        log._start_compaction(Snapshot([], {}, 0, np.zeros(0, dtype=np.uint64), {}))  # retires it
        log.wait_for_compaction()
        assert os.fstat(zombie).st_nlink == 0  # deleted, not renamed for reuse
        os.pwrite(zombie, b"late", res.offset)  # harmless
        assert all(p.stat().st_ino != os.fstat(zombie).st_ino for p in tmp_path.iterdir())
    finally:
        os.close(zombie)
        log.close()


# -- segment files are not reused under readers ----------------------------------------------


def test_a_leased_batch_keeps_its_segments_from_reuse_until_acked(shard_factory, tmp_path):
    shard = shard_factory(
        log_dir=tmp_path / "log", fsync="none", segment_bytes=1 << 16, compact_min_bytes=1 << 16
    )
    kept = big_group("kept", nbytes=8192, size=2, fill=42)
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        assert client.ping()
        client.put(kept)
        lease = client.get(2)
        assert client.shared_get_trajs == 2  # views of the shard's files
        for i in range(120):  # traffic: segments fill, compactions retire them
            client.put(big_group(f"g{i}", nbytes=8192, fill=i))
            client.ack(client.get(1))
            if i % 20 == 0:
                wait_until(shard.server.log.compaction_done, 30, "the shard finished its compaction")
        stats = client.stats()[0].stats
        assert stats["compactions"] >= 2 and stats["retiring_segments"] >= 1
        assert stats["pinned_segments"] >= 1
        assert_identical(lease.trajs, kept)  # its segment was not reused meanwhile
        assert client.ack(lease) == 2
        for i in range(120, 200):
            client.put(big_group(f"g{i}", nbytes=8192, fill=i))
            client.ack(client.get(1))
            if i % 20 == 0:
                wait_until(shard.server.log.compaction_done, 30, "the shard finished its compaction")
        client.ping()
        stats = client.stats()[0].stats
        assert stats["pinned_segments"] == 0 and stats["log_recycled"] > 0
        assert stats["retiring_segments"] <= 1  # (one may wait for the lease just ACKed)


def test_view_pins():
    pins = ViewPins()
    pins.pin_lease("a", [1, 2])
    pins.pin_lease("b", [2])
    pins.hold([3], until=10.0)
    assert [pins.pinned(n, now=5.0) for n in (1, 2, 3, 4)] == [True, True, True, False]
    pins.release_lease("a")
    assert [pins.pinned(n, now=5.0) for n in (1, 2)] == [False, True]
    pins.release_lease("b")  # b expired
    assert not pins.pinned(2, now=5.0) and pins.segments(now=5.0) == 1
    assert not pins.pinned(3, now=10.0) and pins.segments(now=10.0) == 0


def test_replay_samples_hold_their_segments(shard_factory):
    shard = shard_factory(mode="replay", capacity=8)
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        assert client.ping()
        sent = [big_group(f"g{i}")[0] for i in range(4)]
        client.put(sent)
        batch = client.sample(6, seed=0)
        assert client.shared_get_trajs == 6
        assert len(batch.trajs) == 6
        assert_identical(batch.trajs, sent, every=False)  # drawn with replacement
        assert client.stats()[0].stats["pinned_segments"] >= 1


# -- the shard's side -------------------------------------------------------------------------


def test_memory_backed_segments_are_private_and_removed(shard_factory, tmp_path):
    shard = shard_factory(shm_dir=str(tmp_path))
    arena = shard.server.log.shared_dir
    assert arena.parent == tmp_path and oct(arena.stat().st_mode)[-3:] == "700"
    assert oct((arena / same_host.TOKEN_FILE).stat().st_mode)[-3:] == "600"
    orphan = tmp_path / f"{same_host.ARENA_PREFIX}999999999-0-dead"  # a killed shard's leftovers
    orphan.mkdir()
    other = shard_factory(shm_dir=str(tmp_path))
    assert not orphan.exists() and arena.exists()  # the live shard's directory stays
    other.close()
    shard.close()
    assert not arena.exists()


def test_a_shard_configured_for_zmq_offers_no_shared_memory(shard_factory):
    shard = shard_factory(same_host_transport="zmq")
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        assert client.ping() and client.links[0].peer is None
        client.put(big_group("g"))
        assert client.shared_put_bytes == 0 and client.stats()[0].stats["same_host"] == 0
