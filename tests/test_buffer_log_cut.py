"""Compaction that cuts the log instead of copying it: a consumed prefix of segments retires
without its live successors being copied, only live groups lying before the cut are copied,
and recovery from such a log (older snapshots kept in place included) is exact."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from helpers.groups import make_group
from helpers.wait import wait_until

from sluice.buffer.client import BufferClient
from sluice.buffer.dedupe import id_hash
from sluice.buffer.groups import Group
from sluice.buffer.log_cut import choose_cut
from sluice.buffer.log_records import CorruptRecord, SnapshotRecord, read_record
from sluice.buffer.segment_log import SegmentLog, Snapshot
from sluice.buffer.stores.fifo import FifoStore
from sluice.config.buffer import BufferConfig
from sluice.trajectory import Trajectory, to_wire_batch
from sluice.wire import codec

TRANSPORTS = ["zmq", "shm"]  # the shard test runs over both (tests/conftest.py)
GROUP_BYTES = 2 * 4096  # two trajectories of 4 KiB each


def group(gid: str) -> list[Trajectory]:
    return make_group(gid, 2, 0, 4096, ramp=True)


# -- the cut -----------------------------------------------------------------------------------


def test_a_consumed_prefix_is_cut_off_and_nothing_live_is_copied():
    sizes = dict.fromkeys([1, 2, 3, 4], 100)
    live = {3: 50, 4: 100}
    # fewest to reach the target (1 and 2 leave 200 <= 225), and no further: 3 holds live bytes
    assert choose_cut([1, 2, 3, 4], sizes, live, target=225) == 2
    # the target is reached at once, but dead segments at the head retire anyway (free)
    assert choose_cut([1, 2, 3, 4], sizes, {4: 100}, target=1000) == 3


def test_a_straggler_in_the_oldest_segment_is_the_only_thing_copied():
    sizes = dict.fromkeys([1, 2, 3, 4], 100)
    assert choose_cut([1, 2, 3, 4], sizes, {1: 5, 4: 100}, target=157) == 3


def test_a_log_that_is_all_live_stays_and_one_that_cannot_reach_the_target_is_compacted_whole():
    sizes = dict.fromkeys([1, 2, 3], 100)
    assert choose_cut([1, 2, 3], sizes, dict.fromkeys([1, 2, 3], 100), target=450) == 0
    assert choose_cut([1, 2, 3], sizes, {1: 100, 3: 10}, target=150) == 3


# -- over the wire -----------------------------------------------------------------------------


def test_a_fifo_shard_retires_what_was_consumed_without_copying_and_restarts_exactly(shard_factory, tmp_path):
    shard = shard_factory(
        log_dir=tmp_path / "log", fsync="none", segment_bytes=1 << 16, compact_min_bytes=1 << 16
    )
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        for i in range(64):  # 512 KiB in 8 segments, all live: no compaction
            client.put(group(f"g{i}"))
        leases = [client.get(2) for _ in range(48)]  # in order: g0 .. g47
        for lease in leases:
            client.ack(lease)
        # the consumed prefix (6 segments) retires over one compaction or more: a first one may
        # start while the ACKs still arrive (the shard ticks meanwhile), so wait for the bytes
        wait_until(
            lambda: client.stats()[0].stats["compaction_retired_bytes"] >= 4 * (1 << 16),
            30,
            lambda: f"4 segments retired: {client.stats()[0].stats}",
        )
        wait_until(shard.server.log.compaction_done, 30, "the shard finished its compaction")
        stats = client.stats()[0].stats
        # a snapshot holds the dedupe window and settled leases, no group: the 16 left stayed put
        assert stats["compacted_bytes"] < stats["compactions"] * GROUP_BYTES, stats
        client.put(group("late"))  # after the snapshot
    shard.restart()
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        again = client.get(100, wait_ms=5000)
        expected = [f"g{i}/{j}" for i in range(48, 64) for j in range(2)] + ["late/0", "late/1"]
        assert [t.traj_id for t in again.trajs] == expected
        x = again.trajs[1].arrays["x"]
        assert x.tolist() == list(range(1, x.size + 1))  # bytes intact
        for gid in ("g0", "g47", "g63", "late"):  # retired, settled late, in place, after: all seen
            assert client.put(group(gid)).duplicates == 2, gid
        assert client.ack(leases[0]) == 2  # an ACK resent after the restart: settled
        assert client.ack(again) == len(expected)


# -- recovery, with an older snapshot kept in the log ------------------------------------------


class LogDriver:
    """A SegmentLog fed directly, with the live state it should recover."""

    def __init__(self, log_dir: Path, cfg: BufferConfig) -> None:
        self.store = FifoStore(capacity=1000, lease_timeout_s=10)
        self.log = SegmentLog(log_dir, cfg)
        self.log.recover()
        self.live: dict[int, Group] = {}
        self.ids: list[str] = []
        self.settled: dict[str, int] = {}

    def put(self, gid: str) -> None:
        metas, payload = to_wire_batch(group(gid))
        prepared = self.store.prepare_put(metas, codec.split_payload(metas, payload))
        self.log.append_put(prepared)
        self.store.commit_put(prepared)
        self.live.update({g.seq: g for g in prepared.groups})
        self.ids += [m.traj_id for m in metas]

    def ack(self, seqs: list[int]) -> None:
        lease_id = f"lease-{min(seqs)}"
        self.log.append_ack(lease_id, seqs)
        self.settled[lease_id] = 2 * len(seqs)
        for seq in seqs:
            del self.live[seq]

    def compact(self) -> None:
        before = self.log.counters["compactions"]
        snapshot = Snapshot(
            groups=[self.live[s] for s in sorted(self.live)],
            priorities={},
            next_seq=self.store.next_seq,
            seen=np.array([id_hash(i) for i in self.ids], dtype=np.uint64),
            settled=dict(self.settled),
        )
        self.log.tick(time.monotonic(), 0, lambda: snapshot)  # (0 live bytes: it compacts now)
        self.log.wait_for_compaction()
        assert self.log.counters["compactions"] == before + 1


def snapshots(log_dir: Path) -> dict[int, int | None]:
    """Snapshot segment number -> its `resumes_at`."""
    out = {}
    for path in log_dir.glob("*.seg"):
        n = int(path.stem)
        with path.open("rb") as fh:
            try:
                first = read_record(fh, path.stat().st_size, seed=n)
            except CorruptRecord:  # the active segment, not written yet
                continue
        if first is not None and isinstance(first[0], SnapshotRecord):
            out[n] = first[0].resumes_at
    return out


def test_recovery_reads_groups_kept_in_place_and_in_an_older_snapshot(tmp_path):
    cfg = BufferConfig(fsync="none", segment_bytes=1 << 16, compact_min_bytes=1 << 16, compact_ratio=2.0)
    d = LogDriver(tmp_path, cfg)
    for i in range(32):
        d.put(f"g{i}")
    d.ack(list(range(1, 32)))  # g0 stays live: a straggler at the head
    for i in range(32, 48):
        d.put(f"g{i}")
    d.compact()
    first = snapshots(tmp_path)
    ((s1, cut1),) = first.items()
    assert cut1 is not None and cut1 < s1  # a cut, not a full compaction
    assert d.log.counters["compacted_bytes"] < 2 * GROUP_BYTES  # g0 alone was copied
    d.ack(list(range(32, 40)))
    for i in range(48, 64):
        d.put(f"g{i}")
    kept = {p.name: p.read_bytes() for p in tmp_path.glob("*.seg")}
    d.compact()
    ((s2, cut2),) = [(n, c) for n, c in snapshots(tmp_path).items() if n != s1]
    assert cut2 is not None and cut1 <= cut2 < s1 < s2  # the first snapshot is still in the log
    d.log.close()
    for name, data in kept.items():  # a crash before the cut-off segments were deleted
        if not (tmp_path / name).exists():
            (tmp_path / name).write_bytes(data)
    state = SegmentLog(tmp_path, cfg).recover()
    assert [g.seq for g in state.groups] == sorted(d.live)
    assert state.groups[0].group_id == "g0" and state.next_seq == 64
    assert state.settled == d.settled
    assert set(np.concatenate(state.seen_hashes).tolist()) == {id_hash(i) for i in d.ids}
    assert min(int(p.stem) for p in tmp_path.glob("*.seg")) == cut2
