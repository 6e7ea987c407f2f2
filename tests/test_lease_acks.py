"""ACKs sent off the training thread (learner/acks.py): a step's ids stay held while its ACKs
are in flight, a lease gone by then is skipped when it comes back, and an ACK that fails
leaves its step pending; all against a real shard over ZeroMQ."""

from __future__ import annotations

import threading

import pytest
from test_resume import GROUP, groups

from sluice.buffer.client import BufferClient
from sluice.buffer.placement import ShardUnavailable
from sluice.learner.acks import BackgroundAcks
from sluice.learner.leases import LeaseLedger


def ids(batch) -> set[str]:
    return {t.traj_id for t in batch.trajs}


def test_a_step_is_held_until_its_background_acks_are_applied(shard_factory):
    shard = shard_factory(lease_timeout_s=30.0)
    client = BufferClient([shard.endpoint])
    release = threading.Event()

    def make_client() -> BufferClient:
        assert threading.current_thread() is not threading.main_thread()  # the worker's own client
        release.wait(10)  # the ACK stays in flight until the test has looked
        return BufferClient([shard.endpoint])

    ledger = LeaseLedger()
    acks = BackgroundAcks(ledger, make_client)
    try:
        client.put(groups(0, 1))
        trained = client.get(GROUP, wait_ms=0)
        ledger.add(trained, [], 0.0)
        assert acks.send() == []
        assert ledger.pending == [] and len(ledger.in_flight) == 1
        keep, skipped = ledger.filter(trained.trajs)  # a copy now would not be trained
        assert keep == [] and set(skipped) == ids(trained)
        release.set()
        assert acks.collect() == []
        assert ledger.in_flight == [] and ledger.filter(trained.trajs)[1] == []
        assert client.stats()[0].stats["acked"] == GROUP
    finally:
        release.set()
        acks.close()
        client.close()


def test_a_lease_gone_before_its_background_ack_is_never_trained_again(shard_factory):
    now = [0.0]
    shard = shard_factory(lease_timeout_s=5.0)
    shard.server.clock = lambda: now[0]
    client = BufferClient([shard.endpoint])
    ledger = LeaseLedger()
    acks = BackgroundAcks(ledger, lambda: BufferClient([shard.endpoint]))
    try:
        client.put(groups(0, 1))
        trained = client.get(GROUP, wait_ms=0)
        ledger.add(trained, [], 0.0)
        now[0] = 10.0  # the lease ends at the shard before the ACK gets there
        client.stats()
        acks.send()
        assert set(acks.collect()) == ids(trained)  # the next send applies it
        back = client.get(GROUP, wait_ms=0)
        assert ids(back) == ids(trained)
        keep, skipped = ledger.filter(back.trajs)
        assert keep == [] and len(skipped) == GROUP
        ledger.add(back, skipped, 10.0)
        assert acks.send() == []
        assert acks.collect() == []  # the copies ACKed with their own lease, then forgotten
        assert not ledger.skip_ids and client.stats()[0].stats["held"] == 0
    finally:
        acks.close()
        client.close()


def test_an_ack_that_fails_leaves_its_step_pending(shard_factory):
    shard = shard_factory(lease_timeout_s=30.0)
    client = BufferClient([shard.endpoint])
    ledger = LeaseLedger()
    acks = BackgroundAcks(ledger, lambda: BufferClient([shard.endpoint], timeout_s=0.5))
    try:
        client.put(groups(0, 1))
        trained = client.get(GROUP, wait_ms=0)
        ledger.add(trained, [], 0.0)
        shard.close()  # unreachable: the ACK times out
        acks.send()
        with pytest.raises(ShardUnavailable):
            acks.collect()
        assert ledger.in_flight == [] and len(ledger.pending) == 1  # to be ACKed again
        assert ledger.filter(trained.trajs)[0] == []
        acks.send()
    finally:
        acks.close()  # the failure in flight is logged, not raised
        client.close()
    assert len(ledger.pending) == 1
