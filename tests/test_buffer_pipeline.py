"""Fewer round trips: pipelined PUTs (several in flight per shard) and ACKs carried by the next
GET. Both transports; the crash cases (a shard killed with PUTs in flight, with an ACK riding
on a GET) are in test_buffer_recovery.py."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from helpers.groups import byte_of, make_group
from helpers.wait import wait_until

from sluice.buffer.client import BufferClient, BufferError, LeasedBatch
from sluice.trajectory import Trajectory

TRANSPORTS = ["zmq", "shm"]


def group(gid: str, size: int = 2) -> list[Trajectory]:
    """8 KiB per trajectory, every byte a function of the group id (checked by `drain`)."""
    return make_group(gid, size, nbytes=8 << 10, dtype=np.uint8, fill=byte_of(gid))


def drain(client: BufferClient) -> list[str]:
    """Every trajectory still queued, each batch ACKed with the next GET."""
    got: list[str] = []
    used = None
    while True:
        batch = client.get(16, ack=used)
        if used is not None:
            assert batch.acked == len(used.trajs)
        if not batch.trajs:
            return got
        for t in batch.trajs:
            assert (t.arrays["x"] == byte_of(t.group_id)).all()
        got += [t.traj_id for t in batch.trajs]
        used = batch


def test_pipelined_puts_store_each_trajectory_once_across_shards(shard_factory):
    """Two shards, up to four PUTs in flight: replies come back in any order, every group is
    stored once, and sending everything again (pipelined too) stores nothing twice."""
    shards = [shard_factory(), shard_factory()]
    endpoints = [s.endpoint for s in shards]
    sent = [t for i in range(60) for t in group(f"g{i}")]
    with BufferClient(endpoints, timeout_s=10) as producer:
        accepted = duplicates = 0
        with producer.pipeline(window=4) as pipe:
            for i in range(0, len(sent), 6):
                reply = pipe.put(sent[i : i + 6])
                accepted += reply.accepted
                assert len(pipe.in_flight) <= 4
            reply = pipe.flush()
            accepted += reply.accepted
            assert not pipe.in_flight
        assert accepted == len(sent)
        with producer.pipeline(window=3) as pipe:
            for i in range(0, len(sent), 10):
                duplicates += pipe.put(sent[i : i + 10]).duplicates
            duplicates += pipe.flush().duplicates
        assert duplicates == len(sent)
        held = [r.stats["held"] for r in producer.stats()]
        assert sum(held) == len(sent) and all(held)  # (both shards were used)
    with BufferClient(endpoints, timeout_s=10) as consumer:
        got = drain(consumer)
        assert sorted(got) == sorted(t.traj_id for t in sent)
        assert all(r.stats["held"] == 0 and r.stats["leased"] == 0 for r in consumer.stats())


def test_a_pipelined_put_that_fails_is_retried_until_stored(shard_factory):
    """A full shard refuses PUTs in flight (FULL): the pipeline waits and sends them again
    while a slow consumer makes room; nothing is lost or stored twice."""
    shard = shard_factory(capacity=8, retry_after_ms=20)
    sent = [t for i in range(20) for t in group(f"f{i}")]
    got: list[str] = []
    stop = threading.Event()

    def consume() -> None:
        with BufferClient([shard.endpoint], timeout_s=10) as consumer:
            while not stop.is_set():
                batch = consumer.get(2, wait_ms=50)
                got.extend(t.traj_id for t in batch.trajs)
                if batch.trajs:
                    consumer.ack(batch)
                time.sleep(0.01)  # a slow consumer: the shard stays full for a while (the scenario)

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    try:
        with BufferClient([shard.endpoint], timeout_s=10, put_give_up_s=60) as producer:
            with producer.pipeline(window=3) as pipe:
                for i in range(0, len(sent), 4):
                    pipe.put(sent[i : i + 4])  # waits out FULL replies (retried synchronously)
            assert producer.backpressure_s > 0  # (it was full)
        wait_until(lambda: len(got) >= len(sent), 30, lambda: f"every trajectory consumed (got {len(got)})")
    finally:
        stop.set()
        reader.join(timeout=10)
    assert sorted(got) == sorted(t.traj_id for t in sent)


def test_get_carries_the_ack_of_the_batch_before(shard_factory, monkeypatch):
    """`get(ack=batch)`: the lease is ACKed by the GET (one request, not two), counted in
    `acked`; leases of shards the GET does not reach go as ACKs."""
    shards = [shard_factory(), shard_factory()]
    endpoints = [s.endpoint for s in shards]
    with BufferClient(endpoints, timeout_s=10) as client:
        for i in range(20):
            client.put(group(f"a{i}"))
        first = client.get(40)
        assert len(first.trajs) == 40 and len(first.leases) == 2
        before = [r.stats for r in client.stats()]
        settle = BufferClient._settle
        with monkeypatch.context() as m:  # no separate ACK request: the GETs carry both leases
            m.setattr(BufferClient, "_settle", lambda *a: pytest.fail("an ACK went on its own"))
            second = client.get(40, ack=first)  # (nothing left: both shards answer empty)
        assert second.acked == 40 and not second.trajs
        after = [r.stats for r in client.stats()]
        assert all(a["held"] == 0 and a["leased"] == 0 for a in after)
        assert [a["acked"] - b["acked"] for a, b in zip(after, before)] == [b["leased"] for b in before]
        # a batch from both shards, ACKed by a GET that stops at the first (max reached): the
        # other shard's lease goes as an ACK
        for i in range(40):
            client.put(group(f"b{i}"))
        assert all(r.stats["held"] >= 6 for r in client.stats())
        third = client.get(1)  # a group from each shard (each GET starts at the next shard)
        third.extend(client.get(1))
        assert sorted(shard for shard, _ in third.leases) == [0, 1]
        calls = []
        monkeypatch.setattr(
            BufferClient, "_settle", lambda self, b, *a: calls.append(b) or settle(self, b, *a)
        )
        fourth = client.get(1, ack=third)
        assert fourth.acked == 4 and len(fourth.trajs) == 2
        assert len(calls) == 1 and len(calls[0].leases) == 1
        assert client.ack(fourth) == 2


def test_a_get_whose_ack_fails_gives_back_what_it_leased_and_raises(shard_factory):
    shard = shard_factory()
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        for i in range(3):
            client.put(group(f"c{i}"))
        batch = client.get(2)
        assert client.ack(batch) == 2
        stale = LeasedBatch(leases=[(0, "no-such-lease")])
        with pytest.raises(BufferError) as err:
            client.get(2, ack=stale)
        assert err.value.code == "UNKNOWN_LEASE"
        stats = client.stats()[0].stats
        assert stats["held"] == 4 and stats["leased"] == 0  # nothing left leased by the failed call
        replay = client.get(10, ack=batch)  # ACKed before: answered as done, counted again
        assert replay.acked == 2 and len(replay.trajs) == 4
        client.ack(replay)
