"""Admission control (AReaL's rule) and the control server over real ZeroMQ."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq
from helpers.wait import wait_until
from helpers.wire import RawPeer, raw_request

from sluice.control.admission import AdmissionPolicy
from sluice.control.client import ControlClient
from sluice.control.server import ControlServer
from sluice.rpc import RpcAborted, RpcError


def test_admission_rule_by_hand():
    policy = AdmissionPolicy(batch_size=8, max_staleness=1)
    # version 0: quota (0 + 1 + 1) * 8 = 16
    assert policy.admit("a", 12, group_size=4, version=0) == 12
    assert policy.admit("b", 8, group_size=4, version=0) == 4  # whole groups only
    assert policy.admit("a", 4, group_size=4, version=0) == 0  # full: wait
    assert policy.refused_asks == 1
    policy.refund("b", 4)  # aborted work gives its quota back
    assert policy.admit("a", 4, group_size=4, version=0) == 4
    assert policy.admit("a", 8, group_size=4, version=1) == 8  # the learner advanced
    assert policy.started == 24 == policy.quota(1)


def test_admitted_samples_are_never_too_stale_when_consumed_fifo():
    """Simulate: rollouts always hold the learner's latest weights; the learner consumes
    FIFO. Every admitted sample is consumed within the bound."""
    batch, bound = 16, 2
    policy = AdmissionPolicy(batch_size=batch, max_staleness=bound)
    queue: list[int] = []  # versions of produced samples
    version = 0
    for _ in range(200):
        granted = policy.admit("r", 8, group_size=4, version=version)
        queue.extend([version] * granted)
        if len(queue) >= batch:
            consumed, queue = queue[:batch], queue[batch:]
            assert max(version - v for v in consumed) <= bound
            version += 1
    assert version > 20


def test_control_server_round_trip(control):  # (the fixture: tests/conftest.py)
    server, client = control
    assert client.admit("rollout-0", 8, 4).granted == 8
    reply = client.admit("rollout-0", 8, 4)
    assert reply.granted == 0 and reply.retry_after_ms > 0
    server.set_published(1)  # the learner publishes v1, then advances (quota follows the weights)
    server.set_version(1)
    reply = client.admit("rollout-0", 8, 4)
    assert reply.granted == 8 and reply.weights_version == 1
    client.heartbeat("rollout-0", "rollout", {"samples_per_s": 12.5})
    server.update_learner({"reward_mean": 0.5})
    status = client.status()
    assert status.learner["version"] == 1 and status.learner["reward_mean"] == 0.5
    assert status.services["rollout-0"].stats["samples_per_s"] == 12.5
    assert status.admission["started"] == 16


def test_control_server_rejects_bad_input_and_keeps_serving(control, zmq_ctx):
    server, client = control
    with pytest.raises(RpcError) as e:
        client.admit("rollout-0", 0, 4)
    assert e.value.code == "BAD_HEADER" and "n=0" in e.value.message
    reply = raw_request(zmq_ctx, server.endpoint, {"proto": 1, "op": "ADMIT", "id": 9, "n": "lots"})
    assert reply["code"] == "BAD_HEADER" and reply["id"] == 9
    assert client.status().ok


def test_dropped_samples_release_their_quota():
    """Samples admitted but dropped as stale must not hold quota forever (else deadlock)."""
    policy = AdmissionPolicy(batch_size=8, max_staleness=0)
    assert policy.admit("a", 8, 4, version=0) == 8
    assert policy.admit("a", 8, 4, version=1) == 8  # these 8 were then dropped by the buffer
    assert policy.admit("a", 8, 4, version=1) == 0
    policy.release(8)
    assert policy.admit("a", 8, 4, version=1) == 8


def test_a_silent_service_is_forgotten_and_its_undelivered_quota_released():
    server = ControlServer(
        "tcp://127.0.0.1:*",
        AdmissionPolicy(batch_size=8, max_staleness=1),
        service_timeout_s=0.5,
        ctx=zmq.Context(),
    )
    server.start()
    endpoint = server.endpoint
    gone, alive = ControlClient(endpoint, timeout_s=5), ControlClient(endpoint, timeout_s=5)
    try:
        assert gone.admit("rollout-0.aaaa", 12, 4).granted == 12
        gone.heartbeat("rollout-0.aaaa", "rollout", {}, delivered=4)  # then it is killed
        assert alive.admit("rollout-1.bbbb", 8, 4).granted == 4  # quota 16 is used up

        def gone_noticed():  # (the survivor keeps heartbeating meanwhile)
            alive.heartbeat("rollout-1.bbbb", "rollout", {}, delivered=0)
            status = alive.status()
            return status if status.admission["services_gone"] >= 1 else None

        status = wait_until(gone_noticed, 10, "the silent service forgotten", interval_s=0.1)
        assert status.admission["services_gone"] == 1
        assert status.admission["released_gone"] == 8  # admitted 12, delivered 4
        assert status.admission["started"] == 8
        assert "rollout-0.aaaa" not in status.services and "rollout-1.bbbb" in status.services
        assert alive.admit("rollout-1.bbbb", 8, 4).granted == 8  # the rest keep going
    finally:
        gone.close()
        alive.close()
        server.close()


def _admit_in_thread(endpoint: str, service: str, wait_ms: int) -> tuple[threading.Thread, list]:
    """An ADMIT long-poll from its own client (clients are not shared between threads)."""
    out: list = []

    def ask():
        client = ControlClient(endpoint, timeout_s=5)
        try:
            out.append(client.admit(service, 8, 4, wait_ms=wait_ms))
        finally:
            client.close()

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    return thread, out


def _wait_parked(server: ControlServer, n: int) -> None:
    wait_until(lambda: len(server._parked) >= n, 10, f"{n} ADMIT(s) parked", interval_s=0.005)


def test_long_polled_admit_is_answered_when_the_learner_publishes(control):
    server, client = control
    assert client.admit("rollout-0", 8, 4).granted == 8  # quota (8) used up
    thread, out = _admit_in_thread(server.endpoint, "rollout-0", wait_ms=60_000)
    _wait_parked(server, 1)
    assert not out  # no answer while there is no room
    server.set_published(1)  # from this (the learner's) thread: wakes the server
    thread.join(timeout=10)
    assert out and out[0].granted == 8 and out[0].weights_version == 1 and out[0].retry_after_ms == 0


def test_long_polled_admit_times_out_with_nothing_granted(control):
    _, client = control
    assert client.admit("rollout-0", 8, 4).granted == 8
    reply = client.admit("rollout-0", 8, 4, wait_ms=50)
    assert reply.granted == 0 and reply.retry_after_ms == 0  # waited at the server: ask again now


def test_long_polled_admits_are_served_in_arrival_order_and_woken_by_refunds(control):
    server, client = control
    assert client.admit("rollout-0", 8, 4).granted == 8
    first, out_first = _admit_in_thread(server.endpoint, "rollout-1", wait_ms=60_000)
    _wait_parked(server, 1)
    second, out_second = _admit_in_thread(server.endpoint, "rollout-2", wait_ms=60_000)
    _wait_parked(server, 2)
    client.refund("rollout-0", 4)  # one group's room: the first waiter's
    first.join(timeout=10)
    assert out_first and out_first[0].granted == 4 and not out_second
    server.release(4)  # a dropped group (from a learner thread): the second waiter's
    second.join(timeout=10)
    assert out_second and out_second[0].granted == 4


def test_closing_answers_parked_admits():
    server = ControlServer(
        "tcp://127.0.0.1:*", AdmissionPolicy(batch_size=4, max_staleness=0), ctx=zmq.Context()
    )
    server.start()
    client = ControlClient(server.endpoint, timeout_s=5)
    try:
        assert client.admit("rollout-0", 4, 4).granted == 4
        thread, out = _admit_in_thread(server.endpoint, "rollout-1", wait_ms=60_000)
        _wait_parked(server, 1)
    finally:
        client.close()
        server.close()
    thread.join(timeout=10)
    assert out and out[0].granted == 0


def test_a_paused_learner_is_waited_for_and_a_re_sent_admit_is_granted_once(control):
    """The learner holds the server (as a GC pause, a slow checkpoint or SIGSTOP would): the
    client's ADMIT times out and is sent again with the same seq until the learner answers;
    the quota is taken once, not once per send."""
    server, _ = control
    client = ControlClient(server.endpoint, timeout_s=0.3, patience_s=30)
    got: list = []
    try:
        with server._lock:  # the learner side is busy: nothing is dispatched
            thread = threading.Thread(target=lambda: got.append(client.admit("rollout-0.a", 4, 4)))
            thread.start()
            thread.join(1.2)  # ~4 sends, each timed out
            assert thread.is_alive() and not got
        thread.join(10)
        assert got and got[0].granted == 4
        assert server.admission.started == 4 == server.admission.per_service["rollout-0.a"]
        client.refund("rollout-0.a", 4)
        assert server.admission.started == 0
    finally:
        client.close()


def test_a_patient_call_gives_up_at_once_when_its_caller_stops(control):
    """A service stopping (SIGTERM) or whose learner group is over does not wait out a long
    patience: the waiting ADMIT raises RpcAborted within ABORT_CHECK_S of `should_abort`."""
    server, _ = control
    stopping = threading.Event()
    client = ControlClient(server.endpoint, timeout_s=10, patience_s=300, should_abort=stopping.is_set)
    raised: list = []

    def admit() -> None:
        try:
            client.admit("rollout-0.a", 4, 4)
        except RpcAborted as e:
            raised.append(e)

    try:
        with server._lock:  # the learner does not answer
            thread = threading.Thread(target=admit)
            thread.start()
            thread.join(0.5)
            assert thread.is_alive()
            stopping.set()
            t0 = time.monotonic()
            thread.join(5)
            assert not thread.is_alive() and raised and time.monotonic() - t0 < 1.0
    finally:
        client.close()


def test_a_client_without_patience_times_out(control):
    server, _ = control
    client = ControlClient(server.endpoint, timeout_s=0.2)
    try:
        with server._lock, pytest.raises(TimeoutError):
            client.admit("rollout-0.a", 4, 4)
    finally:
        client.close()


def test_repeats_of_a_sequenced_request_are_answered_once(control, zmq_ctx):
    """By hand: a parked ADMIT re-sent takes the original's place; a repeat of an answered
    seq gets the same reply (nothing granted twice); a REFUND repeated refunds once."""
    server, _ = control
    admit = {"op": "ADMIT", "proto": 1, "service_id": "r.x", "n": 8, "group_size": 4, "seq": 1}
    with RawPeer(zmq_ctx, server.endpoint) as peer:
        assert peer.request({**admit, "id": 1})["granted"] == 8  # the whole quota (batch 8)
        assert peer.request({**admit, "id": 2})["granted"] == 8  # a repeat: same answer
        assert server.admission.started == 8
        wait = {**admit, "seq": 2, "wait_ms": 5000}
        peer.sock.send_multipart([b"", msgspec.msgpack.encode({**wait, "id": 3})])
        peer.sock.send_multipart([b"", msgspec.msgpack.encode({**wait, "id": 4})])  # re-sent
        wait_until(  # the re-sent copy has taken the original's place: one parked, and it is id 4
            lambda: [p[1].id for p in list(server._parked)] == [4], 5, "only the re-sent ADMIT parked"
        )
        server.set_published(1)  # quota for 8 more
        assert peer.sock.poll(5000)
        (_, header) = peer.sock.recv_multipart()
        reply = msgspec.msgpack.decode(header)
        assert reply["id"] == 4 and reply["granted"] == 8 and not peer.sock.poll(300)
        assert server.admission.started == 16
        refund = {"op": "REFUND", "proto": 1, "service_id": "r.x", "n": 4, "seq": 3}
        peer.request({**refund, "id": 5})
        peer.request({**refund, "id": 6})
        assert server.admission.started == 12


@pytest.mark.parametrize("last_batch_put", [True, False])
def test_a_dead_service_is_credited_with_what_it_delivered_not_its_last_heartbeat(zmq_ctx, last_batch_put):
    """Released quota = admitted - delivered, exactly: the count comes from the service's newest
    report (its ADMITs carry it, not only its heartbeats) or from what reached the learner,
    whichever is more (a batch PUT after its last report). Releasing more would let the run
    hold more samples in flight than the bound for the rest of the run."""
    server = ControlServer(
        "tcp://127.0.0.1:*",
        AdmissionPolicy(batch_size=64, max_staleness=3),
        service_timeout_s=0.5,
        ctx=zmq_ctx,
    )
    server.start()
    client = ControlClient(server.endpoint, timeout_s=5)
    try:
        client.heartbeat("r.a", "rollout", {}, delivered=0)
        for delivered in (0, 16, 32):  # a batch of 16 PUT between ADMITs
            assert client.admit("r.a", 16, 4, delivered=delivered).granted == 16
        server.seen({"r.a": 48 if last_batch_put else 32})  # the learner's count of its samples
        wait_until(lambda: server.services_gone == 1, 10, "the silent service forgotten")
        assert server.admission.released_gone == (0 if last_batch_put else 16)
        assert server.admission.started == (48 if last_batch_put else 32)
    finally:
        client.close()
        server.close()
