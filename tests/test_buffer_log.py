"""The durable segment log: what a restarted shard rebuilds, torn tails, corruption, compaction."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from helpers.groups import make_group
from helpers.wait import wait_until

from sluice.buffer.client import BufferClient, SampleRef
from sluice.buffer.holder import Holder
from sluice.buffer.log_records import PREFIX
from sluice.buffer.segment_log import LogCorrupt, SegmentLog, Snapshot, recycle_keep
from sluice.buffer.stores.fifo import FifoStore
from sluice.config.buffer import BufferConfig, ReplayConfig
from sluice.trajectory import Trajectory, to_wire_batch
from sluice.wire import codec

TRANSPORTS = ["zmq", "shm"]  # every shard test runs over both (tests/conftest.py)


def group(gid: str, version: int = 0, size: int = 2, nbytes: int = 64) -> list[Trajectory]:
    """x = j, j+1, ... (bytes moved or reordered show) and a second array, of another dtype."""
    return make_group(gid, size, version, nbytes, ramp=True, extra={"m": np.ones(3, dtype=np.bool_)})


def ids(trajs) -> list[str]:
    return [t.traj_id for t in trajs]


def segments(d: Path) -> list[Path]:
    return sorted(d.glob("*.seg"))


# -- restart semantics over the wire --------------------------------------------------------


def test_restart_rebuilds_queue_holds_leases_again_and_forgets_acked(shard_factory, tmp_path):
    shard = shard_factory(log_dir=tmp_path / "log", fsync="none")
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        for g in "abcde":
            client.put(group(g))
        acked = client.get(4)  # a, b
        client.ack(acked)
        leased = client.get(2)  # c: leased, not settled when the shard dies
        assert ids(leased.trajs) == ["c/0", "c/1"]
        shard.restart()
        # the unconsumed d, e come back; c is leased still (its holder's ACK will find it); a, b are gone
        again = client.get(100, wait_ms=5000)
        assert sorted(ids(again.trajs)) == sorted(ids(group("d") + group("e")))
        stats = client.stats()[0].stats
        assert stats["held"] == 6 and stats["leases"] == 2
        assert client.ack(leased) == 2 and client.ack(again) == 4
        # dedupe survives: resending acked or stored ids stores nothing
        assert client.put(group("a")).duplicates == 2
        assert client.put(group("f")).accepted == 2
        stats = client.stats()[0].stats
        assert stats["held"] == 2 and stats["put"] == 2  # counters restart; contents do not


def test_leases_that_ended_without_an_ack_are_not_held_after_a_restart(shard_factory, tmp_path):
    """NACKed, expired and taken-over leases end in the log too: after a restart their groups
    are queued (in order), and a lease held at the restart runs out after a fresh lease timeout."""
    now = [0.0]
    shard = shard_factory(log_dir=tmp_path / "log", lease_timeout_s=10.0)
    shard.clock = shard.server.clock = lambda: now[0]  # (a restart keeps the clock)
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        for g in "abcd":
            client.put(group(g))
        client.nack(client.get(2))  # a: NACKed
        expired = client.get(2)  # a again: will expire
        now[0] = 11.0
        client.stats()  # (the shard expires leases as it serves)
        gone = BufferClient([shard.endpoint], timeout_s=10, holder=Holder("learner/x", "1"))
        try:
            gone.get(2)  # a: its holder is replaced below
        finally:
            gone.close()
        with BufferClient([shard.endpoint], timeout_s=10, holder=Holder("learner/x", "2")) as new:
            held = new.get(2)  # a, taken over from incarnation 1
        assert ids(held.trajs) == ["a/0", "a/1"] and expired.leases != held.leases
        shard.restart()
        back = client.get(100, wait_ms=2000)
        assert ids(back.trajs) == ids(group("b") + group("c") + group("d"))  # a is held by `held`
        client.ack(back)
        now[0] = 22.0  # the held lease's fresh timeout (from the restart at 11) runs out
        client.stats()
        assert ids(client.get(100, wait_ms=2000).trajs) == ["a/0", "a/1"]


def test_compaction_keeps_the_leases_held(shard_factory, tmp_path):
    """A snapshot segment writes the held leases after the live groups: a restart after a
    compaction still finds them."""
    shard = shard_factory(log_dir=tmp_path / "log", segment_bytes=1 << 16, compact_min_bytes=1 << 16)
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        held = None
        for i in range(100):
            client.put(group(f"g{i}", nbytes=4096))
            if i == 0:
                held = client.get(2)
            elif i % 4 == 3:
                client.ack(client.get(6))  # most of it acknowledged: compaction has something to do
        wait_until(shard.server.log.compaction_done, 30, "the shard finished its compaction")
        assert client.stats()[0].stats["compactions"] >= 1
        shard.restart()
        assert client.stats()[0].stats["leases"] == 1
        assert client.ack(held) == 2


def test_ack_resent_after_restart_is_answered_as_done(shard_factory, tmp_path):
    """An ACK whose record was written but whose reply was lost must not become UNKNOWN_LEASE
    (the consumer would think the samples come back)."""
    shard = shard_factory(log_dir=tmp_path / "log")
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        client.put(group("a"))
        batch = client.get(2)
        assert client.ack(batch) == 2
        shard.restart()
        assert client.ack(batch) == 2  # replayed from the log's ACK record
        assert client.get(10, wait_ms=200).trajs == []


def test_stale_drops_survive_restart(shard_factory, tmp_path):
    shard = shard_factory(log_dir=tmp_path / "log")
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        client.put(group("old", version=0))
        client.put(group("new", version=3))
        batch = client.get(10, min_version=2)
        assert batch.dropped_stale == 2
        client.nack(batch)
        shard.restart()
        assert client.stats()[0].versions == {"3": 2}


def test_replay_ring_and_priorities_survive_restart(shard_factory, tmp_path):
    shard = shard_factory(
        log_dir=tmp_path / "log",
        mode="replay",
        capacity=4,
        replay=ReplayConfig(sampling="prioritized", alpha=1.0, eps=1e-9),
    )
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        for g in "abc":
            client.put(group(g))  # capacity 4: a is evicted by c
        client.update_priorities([SampleRef(0, 1), SampleRef(0, 2)], [1.0, 9.0])
        before = client.stats()[0].stats
        shard.restart()
        after = client.stats()[0].stats
        assert after["held"] == before["held"] == 4 and after["stored_groups"] == 2
        batch = client.sample(2000, seed=0, beta=1.0)
        counts = {g: sum(t.group_id == g for t in batch.trajs) / 2 for g in "bc"}
        assert counts["c"] > 5 * counts["b"]  # priorities 1 vs 9 came back
        assert client.put(group("a")).duplicates == 2  # evicted, still remembered for dedupe


# -- the log itself -------------------------------------------------------------------------


def _prepared_put(store: FifoStore, trajs):
    metas, payload = to_wire_batch(trajs)
    return store.prepare_put(metas, codec.split_payload(metas, payload))


def _write_puts(log_dir: Path, cfg: BufferConfig, names: list[str]) -> None:
    store = FifoStore(capacity=1000, lease_timeout_s=10)
    log = SegmentLog(log_dir, cfg)
    log.recover()
    for name in names:
        prepared = _prepared_put(store, group(name))
        log.append_put(prepared)
        store.commit_put(prepared)
    log.close()


def _recovered_group_ids(log_dir: Path, cfg: BufferConfig) -> list[str]:
    log = SegmentLog(log_dir, cfg)
    state = log.recover()
    log.close()
    return [g.group_id for g in state.groups]


def test_records_round_trip_with_payload_bytes_intact(tmp_path):
    cfg = BufferConfig(fsync="none")
    _write_puts(tmp_path, cfg, ["a", "b"])
    log = SegmentLog(tmp_path, cfg)
    state = log.recover()
    log.close()
    assert [g.group_id for g in state.groups] == ["a", "b"] and state.next_seq == 2
    t = state.groups[1].trajs[1]
    arrays = {s.name: codec.view_array(s, f) for s, f in zip(t.meta.arrays, t.frames)}
    assert arrays["x"].tolist() == list(range(1, 17)) and arrays["m"].tolist() == [True] * 3


def test_a_torn_tail_ends_the_log_and_everything_before_it_is_kept(tmp_path):
    cfg = BufferConfig(fsync="none")
    _write_puts(tmp_path, cfg, ["a", "b", "c"])
    seg = segments(tmp_path)[-1]
    data = seg.read_bytes().rstrip(b"\x00")  # (a segment file is made at its full size, sparse)
    seg.write_bytes(data[: len(data) - 40])  # c's record and the seal lost their end (power cut)
    assert _recovered_group_ids(tmp_path, cfg) == ["a", "b"]
    # recovery sealed the segment after b: later recoveries agree, whatever follows the seal
    with open(seg, "ab") as fh:
        fh.write(b"\x00" * 7)
    assert _recovered_group_ids(tmp_path, cfg) == ["a", "b"]
    _write_puts(tmp_path, cfg, ["d"])  # (a fresh store numbers it seq 0 again: it replaces a)
    assert "d" in _recovered_group_ids(tmp_path, cfg)


def test_a_damaged_record_before_the_last_segment_refuses_to_start(tmp_path):
    cfg = BufferConfig(fsync="none")
    _write_puts(tmp_path, cfg, ["a", "b"])
    _write_puts(tmp_path, cfg, ["c"])  # a second segment
    first = segments(tmp_path)[0]
    data = bytearray(first.read_bytes())
    data[PREFIX.size + 40] ^= 0xFF  # flip a bit inside the first record
    first.write_bytes(bytes(data))
    with pytest.raises(LogCorrupt, match="checksum"):
        _recovered_group_ids(tmp_path, cfg)


@pytest.mark.parametrize("policy", ["always", "interval", "none"])
def test_fsync_policies(tmp_path, policy):
    cfg = BufferConfig(fsync=policy, fsync_interval_ms=50)
    store = FifoStore(capacity=100, lease_timeout_s=10)
    log = SegmentLog(tmp_path, cfg)
    log.recover()
    for name in ["a", "b", "c"]:
        prepared = _prepared_put(store, group(name))
        log.append_put(prepared)
        store.commit_put(prepared)
        log.commit()  # what the server does before sending replies
    after_commits = log.counters["fsyncs"]
    time.sleep(0.06)  # the fsync interval (50 ms) passes: what the policies are about
    log.tick(time.monotonic(), 0, None)
    after_tick = log.counters["fsyncs"]
    log.close()
    expected = {"always": (3, 3), "interval": (0, 1), "none": (0, 0)}[policy]
    assert (after_commits, after_tick) == expected


def test_a_log_that_held_much_keeps_every_file_its_compaction_retired(shard_factory, tmp_path):
    """The pool of files for reuse grows to what one compaction retired (not the static
    minimum), so the next cycle writes into cached pages instead of fresh files."""
    log_dir = tmp_path / "log"
    shard = shard_factory(
        log_dir=log_dir, fsync="none", segment_bytes=1 << 16, compact_min_bytes=1 << 16, compact_ratio=2.0
    )
    static = recycle_keep(shard.cfg)
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        for i in range(128):  # 512 KB held: no compaction while it is all live
            client.put(group(f"g{i}", nbytes=4096))
        while (batch := client.get(64, wait_ms=0)).trajs:
            client.ack(batch)
        wait_until_compacted = time.monotonic() + 10
        while shard.server.log.counters["compactions"] == 0 and time.monotonic() < wait_until_compacted:
            client.stats()  # each request lets the shard tick
        wait_until(shard.server.log.compaction_done, 30, "the shard finished its compaction")
        client.stats()
        retired = len(list(log_dir.glob("*.free")))
        assert retired > static, (retired, static)
        assert shard.server.log.pool_max >= retired
        recycled = client.stats()[0].stats["log_recycled"]
        for i in range(64):
            client.put(group(f"h{i}", nbytes=4096))
        assert client.stats()[0].stats["log_recycled"] > recycled


def test_compaction_keeps_the_log_bounded_and_recovery_exact(shard_factory, tmp_path):
    log_dir = tmp_path / "log"
    shard = shard_factory(
        log_dir=log_dir, fsync="none", segment_bytes=1 << 16, compact_min_bytes=1 << 16, compact_ratio=2.0
    )
    payload = 4096
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        for i in range(400):
            client.put(group(f"g{i}", nbytes=payload))
            if i % 4 == 3:  # consume most of what is put, keep a little
                client.ack(client.get(6))
            if i % 50 == 0:
                wait_until(shard.server.log.compaction_done, 30, "the shard finished its compaction")
        stats = client.stats()[0].stats
        held_bytes = stats["held_bytes"]
        assert stats["compactions"] >= 5
        # bound: compact threshold + one segment + records written while a compaction ran
        assert stats["log_bytes"] <= max(1 << 16, 2 * held_bytes) + 3 * (1 << 16)
        # on disk: the log, plus the retired files kept for reuse (a reused file keeps its
        # length: a retired snapshot segment is as long as what was live when it was written)
        files = [*segments(log_dir), *log_dir.glob("*.free")]
        assert len(list(log_dir.glob("*.free"))) <= shard.server.log.pool_max
        slack = len(files) * max(1 << 17, 2 * held_bytes)
        assert sum(p.stat().st_size for p in files) <= stats["log_bytes"] + slack, [
            (p.name, p.stat().st_size) for p in files
        ]
        assert stats["log_recycled"] > 0
        rest = client.get(10000)
        expected = sorted(ids(rest.trajs))
        client.nack(rest)  # (a lease held at the restart would be held after it)
    shard.restart()
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        batch = client.get(10000, wait_ms=5000)
        assert sorted(ids(batch.trajs)) == expected and len(expected) == 200
        assert client.put(group("g0", nbytes=payload)).duplicates == 2  # dedupe window kept


def test_recovery_finishes_an_interrupted_compaction(tmp_path, shard_factory):
    """A crash after the snapshot segment was renamed into place but before the old segments
    were deleted: recovery starts from the snapshot and deletes them. A leftover .tmp (crash
    while writing the snapshot) is ignored."""
    log_dir = tmp_path / "log"
    shard = shard_factory(log_dir=log_dir, fsync="none", compact_min_bytes=1 << 16, segment_bytes=1 << 16)
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        for i in range(20):
            client.put(group(f"g{i}", nbytes=8192))
        client.ack(client.get(30))
        wait_until(shard.server.log.compaction_done, 30, "the shard finished its compaction")
        before = {p.name: p.read_bytes() for p in segments(log_dir)}
    shard.close()
    log = SegmentLog(log_dir, shard.cfg)
    first = log.recover()
    snapshot = Snapshot(
        groups=first.groups,
        priorities={},
        next_seq=first.next_seq,
        seen=np.concatenate(first.seen_hashes),
        settled=first.settled,
    )
    log.tick(time.monotonic(), 0, lambda: snapshot)  # compacts: the log is far above 0 live bytes
    log.close()
    assert log.counters["compactions"] == 1
    # put the pre-compaction segments back, as if their deletion never happened
    for name, data in before.items():
        if not (log_dir / name).exists():
            (log_dir / name).write_bytes(data)
    (log_dir / "999999999999.seg.tmp").write_bytes(b"half a snapshot")
    log = SegmentLog(log_dir, shard.cfg)
    second = log.recover()
    log.close()
    assert [g.seq for g in second.groups] == [g.seq for g in first.groups]
    assert not list(log_dir.glob("*.tmp"))


def test_a_recycled_segment_never_replays_its_old_contents(tmp_path):
    """A retired file reused as a new segment still holds valid-looking records of its old
    life; their checksums are seeded with the old segment number, so they end the segment."""
    cfg = BufferConfig(fsync="none")
    _write_puts(tmp_path, cfg, ["a", "b", "c", "d"])  # segment 1
    (tmp_path / "000000000001.seg").rename(tmp_path / "000000000001.free")  # retired
    log = SegmentLog(tmp_path, cfg)
    log.recover()  # segment 2 reuses the file: its old records are still there, past our writes
    store = FifoStore(capacity=100, lease_timeout_s=10)
    prepared = _prepared_put(store, group("x"))
    log.append_put(prepared)
    log.close()
    assert log.counters["log_recycled"] == 1
    seg = tmp_path / "000000000002.seg"
    assert seg.stat().st_size > 2000  # old bytes past the seal
    data = seg.read_bytes()
    unsealed = tmp_path / "unsealed"
    unsealed.mkdir()
    # the same segment without its seal (the shard died before closing it)
    written = log.counters["log_written_bytes"] - len(_seal_bytes(2))
    (unsealed / seg.name).write_bytes(data[:written] + data[written + len(_seal_bytes(2)) :])
    assert _recovered_group_ids(tmp_path, cfg) == ["x"]
    assert _recovered_group_ids(unsealed, cfg) == ["x"]  # old records are not read either way


def _seal_bytes(n: int) -> bytes:
    from sluice.buffer.log_records import SealRecord, encode_record

    return b"".join(bytes(b) for b in encode_record(SealRecord(), seed=n)[0])


def test_durability_needs_a_place_or_an_explicit_off():
    cfg = BufferConfig()
    assert cfg.shard_log_dir(2, Path("/runs/x")) == Path("/runs/x/buffer/shard-2")
    assert BufferConfig(log_dir="/data/buf").shard_log_dir(1, None) == Path("/data/buf/shard-1")
    assert BufferConfig(durable=False).shard_log_dir(0, None) is None
    with pytest.raises(ValueError, match="buffer.durable"):
        cfg.shard_log_dir(0, None)
