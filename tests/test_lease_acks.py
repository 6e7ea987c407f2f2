"""ACKs that ride on the batch prefetch's GET (learner/source.py, learner/leases.py): a step's
ids stay held until the batch its ACKs rode on is taken, a lease gone by then is found lease by
lease and skipped when it comes back, and ACKs whose batch never came back are settled again
(ACK is idempotent); all against a real shard over ZeroMQ."""

from __future__ import annotations

import threading
import time

import pytest
from test_resume import GROUP, groups

from sluice.buffer.client import BufferClient
from sluice.config.learner import LearnerConfig
from sluice.learner.leases import LeaseLedger
from sluice.learner.source import BatchSource


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
        deadline = time.monotonic() + 30
        while client.stats()[0].stats["held"] < 2 * GROUP:  # the step, and the batch after it
            assert time.monotonic() < deadline, "the prefetch never leased the next batch"
            time.sleep(0.01)
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
