"""FIFO store semantics and the shard server over real ZeroMQ."""

from __future__ import annotations

import threading

import msgspec
import pytest
import zmq
from helpers.groups import make_group
from helpers.wait import wait_until
from helpers.wire import RawPeer

from sluice.buffer.client import BufferClient, BufferError, LeasedBatch
from sluice.buffer.holder import Holder
from sluice.buffer.stores.fifo import FifoStore, GroupIncomplete, ShardFull, Superseded
from sluice.trajectory import Trajectory, to_wire_batch
from sluice.wire import codec

TRANSPORTS = ["zmq", "shm"]  # every shard test runs over both (tests/conftest.py)


def group(gid: str, version: int, size: int = 2, nbytes: int = 16) -> list[Trajectory]:
    return make_group(gid, size, version, nbytes)


def put(store: FifoStore, trajs: list[Trajectory]) -> tuple[int, int]:
    metas, payload = to_wire_batch(trajs)
    return store.put(metas, codec.split_payload(metas, payload))


# -- store ----------------------------------------------------------------------------------


def test_fifo_lease_ack_nack_and_expiry():
    s = FifoStore(capacity=100, lease_timeout_s=10)
    put(s, group("a", 0))
    put(s, group("b", 0))
    lease, dropped = s.get(max_trajs=2, policy_id="default", min_version=0, now=0.0)
    assert dropped == 0 and [g.group_id for g in lease.groups] == ["a"]
    assert s.nack(lease.lease_id) == 2  # back to the front, in order
    lease, _ = s.get(4, "default", 0, now=1.0)
    assert [g.group_id for g in lease.groups] == ["a", "b"]
    assert s.expire(now=5.0) == []
    assert s.expire(now=11.0) == [lease.lease_id]  # timed out: redelivered
    assert s.counters.redelivered_trajs == 2 + 4
    lease, _ = s.get(4, "default", 0, now=12.0)
    assert s.ack(lease.lease_id) == 4
    assert s.size == 0 and s.counters.acked_trajs == 4
    with pytest.raises(KeyError):
        s.ack(lease.lease_id)


def test_lease_hooks_the_shard_asks():
    """What the shard asks through the store interface (it never asks the store's type)."""
    s = FifoStore(capacity=100, lease_timeout_s=10)
    put(s, group("a", 0))
    assert s.next_deadline() is None and s.unevictable_bytes == s.held_bytes > 0
    lease, _ = s.get(2, "default", 0, now=1.0)
    assert s.next_deadline() == 11.0 and s.unevictable_bytes == s.held_bytes  # leased still counts
    s.ack(lease.lease_id)
    assert s.settled_snapshot() == {lease.lease_id: 2} and s.unevictable_bytes == 0
    restored = FifoStore(capacity=100, lease_timeout_s=10)
    restored.restore_settled(s.settled_snapshot())
    assert restored.settled == {lease.lease_id: 2}


def test_a_holders_new_incarnation_takes_over_its_earlier_leases_at_once():
    s = FifoStore(capacity=100, lease_timeout_s=60)
    for gid in "abc":
        put(s, group(gid, 0))
    first, second = Holder("learner/default", "one"), Holder("learner/default", "two")
    old_a, _ = s.get(2, "default", 0, now=0.0, holder=first)
    old_b, _ = s.get(2, "default", 0, now=0.0, holder=first)
    other, _ = s.get(2, "default", 0, now=0.0, holder=Holder("learner/other", "x"))
    assert s.take_over(first) is None  # the same incarnation again: nothing happens
    assert s.take_over(Holder.anonymous()) is None
    orphans = s.take_over(second)
    assert orphans is not None and {lease.lease_id for lease in orphans} == {old_a.lease_id, old_b.lease_id}
    assert set(s.leases) == {other.lease_id}  # another holder's lease stays
    assert s.counters.taken_over_trajs == 4 and s.stats()["taken_over"] == 4
    lease, _ = s.get(4, "default", 0, now=1.0, holder=second)  # at once, in their order
    assert [g.group_id for g in lease.groups] == ["a", "b"]
    with pytest.raises(KeyError):
        s.ack(old_a.lease_id)  # the dead incarnation's lease can no longer be ACKed
    assert s.take_over(second) is None
    with pytest.raises(Superseded):  # the replaced incarnation (a learner thought dead) is refused
        s.take_over(first)
    assert s.incarnations["learner/default"] == "two"


def test_groups_are_never_split():
    s = FifoStore(capacity=100, lease_timeout_s=10)
    put(s, group("a", 0, size=3))
    put(s, group("b", 0, size=3))
    lease, _ = s.get(max_trajs=4, policy_id="default", min_version=0, now=0)
    assert lease.size == 3  # a whole group, not 4 trajectories
    lease, _ = s.get(max_trajs=1, policy_id="default", min_version=0, now=0)
    assert lease.size == 3  # at least one whole group even if larger than asked
    with pytest.raises(GroupIncomplete):
        put(s, group("c", 0, size=3)[:2])


def test_duplicates_are_dropped():
    s = FifoStore(capacity=100, lease_timeout_s=10)
    assert put(s, group("a", 0)) == (2, 0)
    assert put(s, group("a", 0)) == (0, 2)
    assert s.size == 2


def test_capacity_refuses_whole_put():
    s = FifoStore(capacity=3, lease_timeout_s=10)
    put(s, group("a", 0))
    with pytest.raises(ShardFull):
        put(s, group("b", 0))
    assert s.size == 2 and s.counters.refused_full == 2
    s.get(2, "default", 0, now=0)  # leased (a learner holding what it trained for a checkpoint) ...
    assert put(s, group("b", 0)) == (2, 0)  # ... does not count against capacity: queued does
    with pytest.raises(ShardFull):
        put(s, group("c", 0))
    big = FifoStore(capacity=100, lease_timeout_s=10, capacity_bytes=2 * 16)  # bytes: leased count
    put(big, group("a", 0))
    big.get(2, "default", 0, now=0)
    with pytest.raises(ShardFull):
        put(big, group("b", 0))


def test_stale_groups_are_dropped_never_leased():
    s = FifoStore(capacity=100, lease_timeout_s=10)
    for v in (0, 1, 2, 3, 1, 5):
        put(s, group(f"g{v}-{s.counters.put_trajs}", v))
    lease, dropped = s.get(max_trajs=100, policy_id="default", min_version=3, now=0)
    versions = [g.version for g in lease.groups]
    assert all(v >= 3 for v in versions)
    # a stale group queued behind a fresh one is dropped when it reaches the front
    assert versions == [3, 5]
    assert dropped == 8 and s.counters.dropped_stale == 8 and s.queued == 0


# -- server ---------------------------------------------------------------------------------


def test_server_round_trip_with_client(shard_factory):
    shard = shard_factory()
    with BufferClient([shard.endpoint], timeout_s=5) as client:
        reply = client.put(group("a", 0, size=4, nbytes=4096))
        assert reply.accepted == 4
        assert client.put(group("a", 0, size=4, nbytes=4096)).duplicates == 4
        batch = client.get(4)
        assert len(batch.trajs) == 4
        assert [t.traj_id for t in batch.trajs] == [f"a/{j}" for j in range(4)]
        assert batch.trajs[2].arrays["x"].tolist() == [2] * 1024
        assert client.ack(batch) == 4
        stats = client.stats()[0].stats
        assert stats["acked"] == 4 and stats["queued"] == 0


def test_long_poll_get_returns_when_data_arrives(shard_factory):
    shard = shard_factory()
    with (
        BufferClient([shard.endpoint], timeout_s=5) as consumer,
        BufferClient([shard.endpoint], timeout_s=5) as producer,
    ):
        import threading

        got = {}
        t = threading.Thread(target=lambda: got.setdefault("b", consumer.get(2, wait_ms=3000)))
        t.start()
        producer.put(group("late", 0))
        t.join(timeout=5)
        assert len(got["b"].trajs) == 2
        empty = consumer.get(2, wait_ms=50)  # nothing left: an empty reply after the wait
        assert empty.trajs == [] and empty.leases == []


def get_or_error(client: BufferClient, n: int, wait_ms: int) -> LeasedBatch | BufferError:
    try:
        return client.get(n, wait_ms=wait_ms)
    except BufferError as e:
        return e


def test_a_restarted_consumer_gets_what_its_earlier_life_held_without_waiting(shard_factory):
    """A learner killed with leases and a parked GET: its next life's first GET (a new
    incarnation of the same holder) finds those groups requeued, not held for lease_timeout_s;
    the dead life's parked GET is answered empty; an anonymous client is never taken over."""
    shard = shard_factory(lease_timeout_s=600)
    holder = "learner/default"
    with BufferClient([shard.endpoint], timeout_s=5) as producer:
        producer.put(group("a", 0) + group("b", 0))
        dead = BufferClient([shard.endpoint], timeout_s=5, holder=Holder(holder, "first"))
        anonymous = BufferClient([shard.endpoint], timeout_s=5)
        try:
            held = dead.get(2)
            assert [t.group_id for t in held.trajs] == ["a", "a"]
            assert anonymous.get(2).trajs[0].group_id == "b"
            parked: dict = {}
            waiter = threading.Thread(
                target=lambda: parked.setdefault("batch", get_or_error(dead, 2, 30_000))
            )
            waiter.start()
            wait_until(lambda: producer.stats()[0].stats["parked_gets"] == 1, 5, "the GET parked")
            with BufferClient([shard.endpoint], timeout_s=5, holder=Holder(holder, "second")) as resumed:
                batch = resumed.get(4)
                assert [t.traj_id for t in batch.trajs] == [t.traj_id for t in held.trajs]
                waiter.join(timeout=5)
                assert not waiter.is_alive() and isinstance(parked["batch"], BufferError)
                assert parked["batch"].code == "SUPERSEDED"  # its retry after the empty answer
                with pytest.raises(BufferError, match="UNKNOWN_LEASE"):
                    dead.ack(held)
                stats = producer.stats()[0].stats
                assert stats["taken_over"] == 2 and stats["leases"] == 2  # resumed's and anonymous's
                assert resumed.ack(batch) == 2
        finally:
            dead.close()
            anonymous.close()


def test_full_shard_pushes_back(shard_factory):
    shard = shard_factory(capacity=2, retry_after_ms=20)
    with BufferClient([shard.endpoint], timeout_s=5, put_give_up_s=0.2) as client:
        client.put(group("a", 0))
        with pytest.raises(BufferError) as e:
            client.put(group("b", 0))
        assert e.value.code == "FULL" and e.value.retry_after_ms == 20
        assert client.backpressure_s > 0


@pytest.mark.parametrize(
    "frames,code,needle",
    [
        ([b"\xc1garbage"], "BAD_FRAME", "not msgpack"),
        ([msgspec.msgpack.encode([1, 2, 3])], "BAD_FRAME", "not a map"),
        (
            [msgspec.msgpack.encode({"proto": 1, "op": "GET", "id": 5, "max_trajs": -3})],
            "BAD_HEADER",
            "max_trajs",
        ),
        (
            [msgspec.msgpack.encode({"proto": 1, "op": "GET", "id": 5, "max_trajs": 10**9})],
            "TOO_LARGE",
            "max_trajs",
        ),
        ([msgspec.msgpack.encode({"proto": 1, "op": "NOPE", "id": 5})], "BAD_HEADER", "NOPE"),
        ([msgspec.msgpack.encode({"proto": 2, "op": "PING", "id": 5})], "PROTO_VERSION", "proto=2"),
        (
            [msgspec.msgpack.encode({"proto": 1, "op": "ACK", "id": 5, "lease_id": "nope"})],
            "UNKNOWN_LEASE",
            "nope",
        ),
        (
            [msgspec.msgpack.encode({"proto": 1, "op": "PING", "id": 5}), b"extra"],
            "BAD_PAYLOAD",
            "no payload",
        ),
        (
            [
                msgspec.msgpack.encode(
                    {
                        "proto": 1,
                        "op": "PUT",
                        "id": 5,
                        "trajs": [
                            {
                                "traj_id": "t",
                                "group_id": "g",
                                "version": 0,
                                "arrays": [{"name": "x", "dtype": "float32", "shape": [4]}],
                            }
                        ],
                    }
                ),
                b"short",
            ],
            "BAD_PAYLOAD",
            "frame 1",
        ),
    ],
)
def test_bad_messages_get_error_replies_and_the_server_keeps_serving(
    shard_factory, zmq_ctx, frames, code, needle
):
    shard = shard_factory()
    with RawPeer(zmq_ctx, shard.endpoint) as peer:
        reply = peer.ask(frames)
        assert reply is not None, "no reply"
        assert reply["ok"] is False and reply["op"] == "ERROR"
        assert reply["code"] == code, reply
        assert needle in reply["message"], reply
        # still serving, and the good request after it works
        pong = peer.request({"proto": 1, "op": "PING", "id": 6})
        assert pong["ok"] is True and pong["id"] == 6


def test_req_socket_clients_work_too(shard_factory, zmq_ctx):
    shard = shard_factory()
    sock = zmq_ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(shard.endpoint)
    sock.send(msgspec.msgpack.encode({"proto": 1, "op": "STATS", "id": 1}))
    assert sock.poll(5000)
    reply = msgspec.msgpack.decode(sock.recv())
    assert reply["ok"] and reply["stats"]["queued"] == 0
    sock.close()


def test_stale_samples_are_never_delivered_over_the_wire(shard_factory):
    shard = shard_factory()
    with BufferClient([shard.endpoint], timeout_s=5) as client:
        for v in range(6):
            client.put(group(f"v{v}", v))
        batch = client.get(100, min_version=4)
        assert sorted({t.version for t in batch.trajs}) == [4, 5]
        assert batch.dropped_stale == 8
        assert client.stats()[0].stats["dropped_stale"] == 8


def test_stale_samples_dropped_while_a_get_waits_are_told_in_its_reply(shard_factory):
    """A long-polled GET waits on an empty shard; stragglers too old for it arrive first (each
    wakes it, is dropped, and it waits on), then a fresh group: its reply counts those drops
    too (the learner gives their admission quota back from it)."""
    shard = shard_factory()
    with BufferClient([shard.endpoint], timeout_s=5) as producer, BufferClient([shard.endpoint]) as consumer:
        got = []
        waiter = threading.Thread(target=lambda: got.append(consumer.get(100, min_version=5, wait_ms=8000)))
        waiter.start()
        try:
            wait_until(lambda: producer.stats()[0].stats["parked_gets"] == 1, 5, "the GET parked")
            for v in range(3):
                producer.put(group(f"old{v}", v))  # 6 trajectories, all too old for min_version 5
            wait_until(lambda: producer.stats()[0].stats["dropped_stale"] == 6, 5, "the stale groups dropped")
            producer.put(group("fresh", 5))
        finally:
            waiter.join(10)
        assert got and got[0].dropped_stale == 6 and [t.version for t in got[0].trajs] == [5, 5]
