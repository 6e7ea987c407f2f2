"""The client over several shards: placement, fair reads, down shards, pinning, batching, leases."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import zmq
from helpers.groups import make_group
from helpers.wait import wait_until

from sluice.buffer.client import BufferClient, BufferError, ShardUnavailable, shard_of

TRANSPORTS = ["zmq", "shm"]  # every shard test runs over both (tests/conftest.py)


def group(gid: str, size: int = 2) -> list:
    return make_group(gid, size, nbytes=64)


def gids_with_home(home: int, n_shards: int, count: int, prefix: str = "g") -> list[str]:
    out, i = [], 0
    while len(out) < count:
        gid = f"{prefix}{i}"
        if shard_of(gid, n_shards) == home:
            out.append(gid)
        i += 1
    return out


def test_groups_stay_whole_on_their_home_shard(shard_factory):
    shards = [shard_factory() for _ in range(3)]
    with BufferClient([s.endpoint for s in shards], timeout_s=5) as client:
        trajs = [t for i in range(30) for t in group(f"g{i}", size=4)]
        assert client.put(trajs).accepted == 120  # one call, one message per shard
        expected = Counter(shard_of(f"g{i}", 3) for i in range(30))
        assert len(expected) == 3
        assert [r.stats["held"] for r in client.stats()] == [4 * expected[k] for k in range(3)]
        batch = client.get(1000)
        per_group = Counter(t.group_id for t in batch.trajs)
        assert len(per_group) == 30 and set(per_group.values()) == {4}


def test_reads_visit_every_shard_in_turn(shard_factory):
    shards = [shard_factory() for _ in range(2)]
    with BufferClient([s.endpoint for s in shards], timeout_s=5) as client:
        for home in (0, 1):
            for gid in gids_with_home(home, 2, 10, prefix=f"h{home}-"):
                client.put(group(gid, size=1))
        served = []
        for _ in range(10):
            batch = client.get(1)
            served.append(batch.leases[0][0])
            client.ack(batch)
        assert Counter(served) == {0: 5, 1: 5}


def seen_down(link) -> bool:
    link.pump_events()  # the connection events the client has not read yet
    return not link.connected


def test_new_groups_route_around_a_down_shard_and_reads_skip_it(shard_factory):
    up, down = shard_factory(), shard_factory()
    with BufferClient([up.endpoint, down.endpoint], timeout_s=5) as client:
        assert client.ping(timeout_s=10)
        down.close()
        # Routing around needs the client to know: a PUT sent before it saw the disconnect may
        # have been stored there, so it stays pinned to that shard (the next test's case).
        wait_until(lambda: seen_down(client.links[1]), 10, "the client did not see shard 1 go down")
        gids = gids_with_home(1, 2, 10)
        reply = client.put([t for g in gids for t in group(g)])
        assert reply.accepted == 20 and client.rerouted_groups == 10
        batch = client.get(100)  # the down shard is skipped, not waited for
        assert sorted({t.group_id for t in batch.trajs}) == sorted(gids)
        assert client.ack(batch) == 20
        assert not client.ping(timeout_s=0.3)


def test_a_put_that_may_have_arrived_stays_pinned_and_gives_up(shard_factory, zmq_ctx):
    """A shard that takes requests and never answers: the PUT may have been stored there, so it
    is retried there only (never rerouted, which could store it twice) and fails after the
    give-up time instead of blocking."""
    hole = zmq_ctx.socket(zmq.ROUTER)
    hole.setsockopt(zmq.LINGER, 0)
    hole_ep = f"tcp://127.0.0.1:{hole.bind_to_random_port('tcp://127.0.0.1')}"
    good = shard_factory()
    gid = gids_with_home(0, 2, 1)[0]
    with BufferClient([hole_ep, good.endpoint], timeout_s=0.3, put_give_up_s=1.5) as client:
        # (no PING first: a failed one would mark the hole down, and a new group would then
        # rightly go to the good shard)
        with pytest.raises(ShardUnavailable):
            client.put(group(gid))
        with pytest.raises(ShardUnavailable):
            client.put(group(gid))  # the caller's own retry is pinned too
        assert client.links[0].failures < 100  # backed off, did not spin
    with BufferClient([good.endpoint], timeout_s=5) as observer:
        assert observer.stats()[0].stats["held"] == 0
    puts = 0
    while hole.poll(100):
        frames = hole.recv_multipart()
        puts += b"PUT" in frames[2]
    assert puts >= 1  # the PUTs went to the hole (and never to the good shard)


def test_an_ack_to_a_shard_that_is_gone_gives_up_once_its_role_stops(shard_factory):
    """A stopping learner does not retry its ACKs for the client's whole timeout (30 s here)
    when the shard is gone: `should_abort` ends the retries (the lease comes back when it
    expires; a resumed learner settles it). Without it, the ACK would retry for 30 s."""
    shard = shard_factory()
    stop = threading.Event()
    with BufferClient([shard.endpoint], timeout_s=30, should_abort=stop.is_set) as client:
        client.put(group("g0"))
        batch = client.get(4)
        shard.close()
        wait_until(lambda: seen_down(client.links[0]), 10, "the client did not see the shard go down")
        timer = threading.Timer(0.5, stop.set)
        timer.start()
        started = time.monotonic()
        with pytest.raises(ShardUnavailable, match="gave up"):
            client.ack(batch)
        timer.join()
        assert time.monotonic() - started < 15  # well before the client's 30 s
        assert stop.is_set()


@pytest.mark.parametrize("bad", ["gone", "silent"])
def test_stats_of_a_shard_that_does_not_answer_ends_once_its_role_stops(bad, shard_factory, zmq_ctx):
    """A role stopped during its start-up (the learner asks every shard's STATS there) stops
    waiting for a shard that is gone, or takes requests and never answers, instead of the
    client's whole timeout (30 s here): the call ends Abandoned, a missing reply with
    `missing_ok`, ShardUnavailable without."""
    good = shard_factory()
    if bad == "gone":
        gone = shard_factory()
        gone.close()
        bad_ep = gone.endpoint
    else:
        hole = zmq_ctx.socket(zmq.ROUTER)
        hole.setsockopt(zmq.LINGER, 0)
        bad_ep = f"tcp://127.0.0.1:{hole.bind_to_random_port('tcp://127.0.0.1')}"
    stop = threading.Event()
    with BufferClient([good.endpoint, bad_ep], timeout_s=30, should_abort=stop.is_set) as client:
        timer = threading.Timer(0.5, stop.set)
        timer.start()
        started = time.monotonic()
        good_stats, bad_stats = client.stats(missing_ok=True)
        timer.join()
        assert time.monotonic() - started < 15  # well before the client's 30 s
        assert good_stats is not None and bad_stats is None
        with pytest.raises(ShardUnavailable, match="abandoned|not connected"):
            client.stats()


def test_put_waits_for_a_shard_that_starts_late(shard_factory):
    shard = shard_factory()
    shard.close()  # not up yet when the producer starts
    result = {}
    with BufferClient([shard.endpoint], timeout_s=5, put_give_up_s=30, first_connect_s=0.2) as client:
        t = threading.Thread(target=lambda: result.setdefault("reply", client.put(group("late"))))
        t.start()
        wait_until(lambda: client.links[0].failures >= 1, 10, "the PUT found no shard (it retries)")
        shard.start()
        t.join(timeout=30)
        assert result["reply"].accepted == 2


def test_long_poll_takes_the_first_shard_with_data_and_cancels_the_rest(shard_factory):
    shards = [shard_factory() for _ in range(3)]
    eps = [s.endpoint for s in shards]
    with BufferClient(eps, timeout_s=5) as consumer, BufferClient(eps, timeout_s=5) as producer:
        assert consumer.ping(timeout_s=10) and producer.ping(timeout_s=10)
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("b", consumer.get(4, wait_ms=10_000)))
        t.start()
        wait_until(lambda: all(s.server.parked for s in shards), 10, "the GET parked on every shard")
        gid = gids_with_home(2, 3, 1)[0]
        producer.put(group(gid))
        t.join(timeout=30)
        assert [x.group_id for x in got["b"].trajs] == [gid, gid]
        # no GET is left parked on the other shards (CANCEL worked), nothing else is leased
        stats = [r.stats for r in producer.stats()]
        assert [s["parked_gets"] for s in stats] == [0, 0, 0]
        assert [s["leased"] for s in stats] == [0, 0, 2]


def test_batcher_collects_small_puts(shard_factory):
    shard = shard_factory()
    with BufferClient([shard.endpoint], timeout_s=5) as client:
        with client.batcher(max_trajs=4, max_bytes=1 << 20, linger_s=60) as batcher:
            for i in range(3):
                assert batcher.add(group(f"g{i}", size=1)) is None
            assert client.stats()[0].stats["held"] == 0  # nothing sent yet
            assert batcher.add(group("g3", size=1)).accepted == 4
            assert batcher.add(group("g4", size=1)) is None
        assert client.stats()[0].stats["held"] == 5  # flushed on leaving the block
        with client.batcher(max_trajs=100, max_bytes=1 << 20, linger_s=0.0) as batcher:
            assert batcher.add(group("g5", size=1)).accepted == 1  # lingered long enough


def test_large_puts_are_split_to_the_shard_limits(shard_factory):
    shard = shard_factory(max_batch=4)
    with BufferClient([shard.endpoint], timeout_s=5, max_batch=4, put_message_bytes=1 << 20) as client:
        reply = client.put([t for i in range(10) for t in group(f"g{i}", size=1)])
        assert reply.accepted == 10
        with pytest.raises(ValueError, match="max_batch"):
            client.put(group("big", size=5))


def test_lease_expiry_redelivers_over_the_wire(shard_factory):
    shard = shard_factory(lease_timeout_s=0.3)
    with BufferClient([shard.endpoint], timeout_s=5) as client:
        client.put(group("a"))
        first = client.get(2)
        time.sleep(0.5)  # the consumer "crashed" (no ACK) and the lease times out: what is tested
        second = client.get(2, wait_ms=2000)
        assert [t.traj_id for t in second.trajs] == [t.traj_id for t in first.trajs]
        assert client.stats()[0].stats["redelivered"] == 2
        with pytest.raises(BufferError) as e:
            client.ack(first)
        assert e.value.code == "UNKNOWN_LEASE"
        assert client.ack(second) == 2


def test_full_shard_slows_the_producer_until_space_frees(shard_factory):
    shard = shard_factory(capacity=2, retry_after_ms=50)
    with (
        BufferClient([shard.endpoint], timeout_s=5) as producer,
        BufferClient([shard.endpoint], timeout_s=5) as consumer,
    ):
        producer.put(group("a"))
        done = {}
        t = threading.Thread(target=lambda: done.setdefault("r", producer.put(group("b"))))
        t.start()
        wait_until(lambda: consumer.stats()[0].stats["refused_full"] >= 2, 10, "the PUT refused twice (FULL)")
        assert "r" not in done  # waiting out backpressure, not failing, not growing the shard
        consumer.ack(consumer.get(2))
        t.join(timeout=10)
        assert done["r"].accepted == 2 and producer.backpressure_s > 0
