"""ACKs that ride on the batch prefetch's GET (learner/source.py, learner/leases.py): a step's
ids stay held until the batch its ACKs rode on is taken, a lease gone by then is found lease by
lease and skipped when it comes back, and ACKs whose batch never came back are settled again
(ACK is idempotent); all against a real shard over ZeroMQ."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
from helpers.wait import wait_until
from test_resume import GROUP, groups

from sluice.buffer.client import BufferClient, LeasedBatch
from sluice.config.learner import LearnerConfig
from sluice.learner.leases import LeaseLedger
from sluice.learner.source import BatchSource
from sluice.net import free_port
from sluice.trajectory import Trajectory


def ids(batch) -> set[str]:
    return {t.traj_id for t in batch.trajs}


def source_of(shard, prefetch: bool = True) -> BatchSource:
    lc = LearnerConfig(batch_size=GROUP, get_wait_ms=50, prefetch=prefetch)
    return BatchSource([shard.endpoint], "default", lc, threading.Event(), lease_timeout_s=60)


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_step_is_held_until_the_batch_its_acks_rode_on_is_taken(shard_factory, prefetch):
    shard = shard_factory(lease_timeout_s=30.0)
    client = BufferClient([shard.endpoint])
    source = source_of(shard, prefetch)
    ledger = LeaseLedger()
    try:
        client.put(groups(0, 2))
        trained = client.get(GROUP, wait_ms=0)
        ledger.add(trained, [], 0.0)
        source.request(0, ledger.detach())
        assert ledger.pending == [] and len(ledger.in_flight) == 1
        keep, skipped = ledger.filter(trained.trajs)  # a copy now would not be trained
        assert keep == [] and set(skipped) == ids(trained)
        fetched = source.take()
        assert fetched is not None and fetched.ack_outcomes == [(GROUP, True)]
        assert ids(fetched.leased).isdisjoint(ids(trained)) and len(fetched.leased.trajs) == GROUP
        assert ledger.apply(fetched.settled, fetched.ack_outcomes) == (GROUP, [])
        assert ledger.in_flight == [] and ledger.filter(trained.trajs)[1] == []
        stats = client.stats()[0].stats
        assert stats["acked"] == GROUP and stats["held"] == GROUP  # ACKed with the next GET
    finally:
        source.close()
        client.close()


def test_a_lease_gone_before_its_ack_rides_is_never_trained_again(shard_factory):
    now = [0.0]
    shard = shard_factory(lease_timeout_s=5.0)
    shard.server.clock = lambda: now[0]
    client = BufferClient([shard.endpoint])
    source = source_of(shard)
    ledger = LeaseLedger()
    try:
        client.put(groups(0, 1))
        trained = client.get(GROUP, wait_ms=0)
        ledger.add(trained, [], 0.0)
        now[0] = 10.0  # the lease ends at the shard before the ACK gets there
        client.stats()
        source.request(0, ledger.detach())
        fetched = source.take()  # the GET carrying it failed; lease by lease, then leased again
        assert fetched is not None and fetched.ack_outcomes == [(0, False)]
        assert ids(fetched.leased) == ids(trained)  # the expired lease's group, queued again
        lost = ledger.apply(fetched.settled, fetched.ack_outcomes)[1]
        assert set(lost) == ids(trained)
        keep, skipped = ledger.filter(fetched.leased.trajs)
        assert keep == [] and len(skipped) == GROUP
        ledger.add(fetched.leased, skipped, 10.0)
        assert ledger.settle(client) == (GROUP, [])  # the copies ACKed with their own lease ...
        assert not ledger.skip_ids and client.stats()[0].stats["held"] == 0  # ... then forgotten
    finally:
        source.close()
        client.close()


def test_acks_whose_batch_never_came_back_are_settled_again(shard_factory):
    """The learner stops with a prefetched batch not taken: its GET ACKed the step, but the
    outcome never reached the ledger. The final checkpoint's ACK of the step answers
    `replayed` (the learner's `_ack_trained`), and the batch goes back to the queue."""
    shard = shard_factory(lease_timeout_s=30.0)
    client = BufferClient([shard.endpoint])
    source = source_of(shard)
    ledger = LeaseLedger()
    try:
        client.put(groups(0, 2))
        trained = client.get(GROUP, wait_ms=0)
        ledger.add(trained, [], 0.0)
        source.request(0, ledger.detach())
        wait_until(
            lambda: (lambda st: st["acked"] == GROUP and st["leased"] == GROUP)(client.stats()[0].stats),
            30,
            "the prefetch's GET: the step ACKed, the batch after it leased",
        )
    finally:
        source.close()  # fetched, never taken: given back
    try:
        assert client.stats()[0].stats["acked"] == GROUP
        ledger.undo(list(ledger.in_flight))
        assert ledger.settle(client) == (GROUP, [])
        assert ledger.pending == ledger.in_flight == [] and not ledger.skip_ids
        again = client.get(2 * GROUP, wait_ms=0)
        assert ids(again).isdisjoint(ids(trained)) and len(again.trajs) == GROUP
    finally:
        client.close()


def test_a_shard_is_unreachable_only_from_a_lost_connection_until_it_is_back(shard_factory):
    """What decides whether a step's ACKs ride (learner/source.py): a link still making its
    first connection is reachable (a request waits for it: a learner's first steps must not
    be deferred), one whose connection was seen lost is not, until it is back."""
    with BufferClient([f"tcp://127.0.0.1:{free_port()}"], first_connect_s=0.1) as nobody:
        assert nobody.reachable(0)  # (nothing listens: no connection yet, none lost)
    shard = shard_factory()
    with BufferClient([shard.endpoint]) as client:
        client.stats()  # connected
        assert client.reachable(0)
        shard.close()
        wait_until(lambda: not client.reachable(0), 10, "the lost connection seen")
        shard.start()
        wait_until(lambda: client.reachable(0), 10, "the connection back")


@dataclass
class TwoShards:
    """A source over two shards, a trained step leased on each (the ledger's two pending steps),
    one batch fetched (both links up), then the second shard closed: what a kill leaves."""

    source: BatchSource
    ledger: LeaseLedger
    live: BufferClient  # a client of the first shard only, to put more groups there
    dead: object  # the second shard (conftest's RunningShard), closed
    steps: list[list[str]]  # each step's ids: on the live shard, on the dead one
    on_dead: list[Trajectory]  # the trajectories of the step leased on the dead shard


@contextmanager
def one_step_on_each_of_two_shards(shard_factory, prefetch: bool) -> Iterator[TwoShards]:
    live, dead = shard_factory(lease_timeout_s=30.0), shard_factory(lease_timeout_s=30.0)
    lc = LearnerConfig(batch_size=GROUP, get_wait_ms=50, prefetch=prefetch)
    source = BatchSource([live.endpoint, dead.endpoint], "default", lc, threading.Event(), 60)
    ledger = LeaseLedger()
    clients = [BufferClient([live.endpoint]), BufferClient([dead.endpoint])]
    try:
        for k, client in enumerate(clients):
            client.put(groups(10 * k, 1))
            leased = client.get(GROUP, wait_ms=0)
            ledger.add(LeasedBatch(leased.trajs, [(k, lease) for _, lease in leased.leases]), [], 0.0)
        clients[0].put(groups(20, 2))
        source.request(0)  # both links connect
        assert source.take() is not None
        clients[1].close()
        dead.close()
        steps = [list(step.traj_ids) for step in ledger.pending]
        yield TwoShards(source, ledger, clients[0], dead, steps, leased.trajs)
    finally:
        source.close()
        for client in clients:
            client.close()


def test_a_step_on_a_shard_that_is_down_waits_for_it_without_holding_up_the_batch(shard_factory):
    """Two shards, one down (killed, not yet restarted): the next batch comes from the live one
    at once, carrying the ACK of the step leased there; the step leased on the dead shard is
    deferred (pending, its ids still held) and settled by a GET after the shard is back. Before,
    the GET retried that ACK until the client's timeout (30 s), then failed the learner."""
    with one_step_on_each_of_two_shards(shard_factory, prefetch=True) as run:
        source, ledger, on_dead = run.source, run.ledger, set(run.steps[1])
        source.request(1, ledger.detach())
        fetched = source.take()  # (before: raised after 30 s, "ACK gave up")
        assert fetched is not None and len(fetched.leased.trajs) == GROUP
        assert [s.traj_ids for s in fetched.settled] == [run.steps[0]]
        assert fetched.ack_outcomes == [(GROUP, True)]
        assert [set(s.traj_ids) for s in fetched.deferred] == [on_dead]
        ledger.apply(fetched.settled, fetched.ack_outcomes)
        ledger.undo(fetched.deferred)
        assert ledger.pending_ids() == on_dead and ledger.filter(run.on_dead)[0] == []  # ids still held
        run.dead.start()  # (not durable: the lease died with it)
        deadline, more = time.monotonic() + 30, 30
        while time.monotonic() < deadline:  # until the source's client has reconnected
            run.live.put(groups(more, 1))  # (version 0, as the rest: not too stale at 1)
            source.request(1, ledger.detach())
            fetched = source.take()
            assert fetched is not None
            ledger.undo(fetched.deferred)
            if fetched.settled:
                break
            more += 1
        assert fetched.ack_outcomes == [(0, False)], "the shard never came back for the ACK"
        assert set(ledger.apply(fetched.settled, fetched.ack_outcomes)[1]) == on_dead
        assert ledger.pending == ledger.in_flight == [] and on_dead <= ledger.skip_ids


def test_a_shard_that_dies_after_the_check_defers_its_step_all_the_same(shard_factory, monkeypatch):
    """The race the reachability check cannot see: the shard dies after the check, before the
    GET that carries its ACK. That ACK is sent once, not retried for the client's 30 s: the GET
    fails, the step on the live shard is ACKed again on its own (`replayed`, counted), the
    other is deferred, and the batch is leased by the next GET."""
    with one_step_on_each_of_two_shards(shard_factory, prefetch=False) as run:
        client = run.source._client  # (prefetch off: the source's own client)
        assert client is not None
        asked, seen = itertools.count(), client.reachable
        monkeypatch.setattr(client, "reachable", lambda k: next(asked) < 2 or seen(k))  # the race
        run.source.request(1, run.ledger.detach())
        fetched = run.source.take()  # (without the one-shot ACK: ShardUnavailable after 30 s)
        assert fetched is not None and len(fetched.leased.trajs) == GROUP
        assert [s.traj_ids for s in fetched.settled] == [run.steps[0]]
        assert fetched.ack_outcomes == [(GROUP, True)]
        assert [s.traj_ids for s in fetched.deferred] == [run.steps[1]]
        assert fetched.gets == 2  # the one that failed, then the batch


def test_a_checkpoints_acks_keep_a_step_on_a_shard_that_is_down_pending(shard_factory):
    """What a learner's checkpoint ACKs (`LeaseLedger.settle`) with one of two shards down: the
    step leased on the live shard is ACKed, the one on the dead shard stays pending (its ids
    held) and no longer counts toward the age that makes a checkpoint due; once the shard is
    back, the next settle finds its lease gone (not durable) and skips the ids. Before, the ACK
    was retried for the client's timeout (30 s), then raised, and the learner failed."""
    with one_step_on_each_of_two_shards(shard_factory, prefetch=False) as run:
        client, ledger = run.source._client, run.ledger
        assert client is not None
        wait_until(lambda: not client.reachable(1), 10, "the lost connection seen")
        assert ledger.settle(client) == (GROUP, [])  # (before: ShardUnavailable after 30 s)
        assert [s.traj_ids for s in ledger.pending] == [run.steps[1]] and ledger.in_flight == []
        assert ledger.pending_ids() == set(run.steps[1]) and ledger.pending_shards() == {1}
        now = time.monotonic()
        assert ledger.oldest_age(now) == now  # (the fixture leased both at time 0)
        assert ledger.oldest_age(now, reachable=client.reachable) == 0.0
        run.dead.start()
        wait_until(lambda: client.reachable(1), 10, "the connection back")
        assert ledger.settle(client) == (0, run.steps[1])
        assert ledger.pending == [] and set(run.steps[1]) <= ledger.skip_ids
