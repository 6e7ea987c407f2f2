"""Receivers sleep on the learner's store-change notices (weight_sync/notices.py) instead of
asking the store every few milliseconds, and every store write they wait for sends one."""

from __future__ import annotations

import threading
import time

import torch
import zmq
from helpers.wait import wait_until
from helpers.weight_sync_env import wait_version

import sluice.weight_sync.notices as notices_module
import sluice.weight_sync.receiver as receiver_module
from sluice.config.security import SecurityConfig
from sluice.security import generate_keys, secure_context
from sluice.weight_sync.notices import NoticeListener, NoticePublisher


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(50, 24), torch.nn.Linear(24, 50))


class CountingStore:
    """A receiver's store that counts the lookups (`check`) made through it."""

    def __init__(self, store) -> None:
        self._store = store
        self.checks = 0

    def check(self, keys):
        self.checks += 1
        return self._store.check(keys)

    def __getattr__(self, name):
        return getattr(self._store, name)


def notices_through(publisher: NoticePublisher, listener: NoticeListener, within_s: float) -> bool:
    """Notify until the listener hears one (a subscription takes effect asynchronously)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        publisher.notify()
        if listener.wait(0.05):
            return True
    return False


def test_a_listener_wakes_on_a_notice_and_otherwise_sleeps_out_its_timeout(zmq_ctx):
    publisher = NoticePublisher(zmq_ctx, "127.0.0.1")
    listener = NoticeListener(zmq_ctx, publisher.endpoint)
    try:
        assert notices_through(publisher, listener, 10)
        while listener.wait(0.05):  # whatever of those notices were still on their way
            pass
        assert not listener.wait(0.01)  # nothing written: nothing heard
        publisher.notify()
        wait_until(lambda: listener.wait(0.05), 10, "the notice")  # one wait is 50 ms at most
    finally:
        listener.close()
        publisher.close()
    publisher.notify()  # closed: nothing to tell, and no error


def test_notices_may_come_from_several_threads_at_once(zmq_ctx):
    """The confirmation, checksum and training threads all write keys: the PUB socket is
    shared under a lock and none of them blocks."""
    publisher = NoticePublisher(zmq_ctx, "127.0.0.1")
    try:
        threads = [
            threading.Thread(target=lambda: [publisher.notify() for _ in range(500)]) for _ in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        assert not any(t.is_alive() for t in threads)
    finally:
        publisher.close()


def test_an_idle_receiver_looks_at_the_store_at_the_fallback_rate_only(env_factory):
    """Waiting for the next announcement, a receiver asked the store every 5 ms (200 times a
    second, ~8% of a core each on the vs_trl workload); now at most every NOTICE_FALLBACK_S."""
    env = env_factory()
    env.broadcaster.publish(0, tiny_model())
    receiver = env.receiver("rollout-0")
    env.wait_members(1)
    model = tiny_model(1)
    assert env.broadcaster.publish(1, model).delivered
    wait_version(receiver, 1)
    store = CountingStore(receiver._store)
    receiver._store = store
    time.sleep(1.0)  # idle: nothing announced
    idle_checks = store.checks
    # a look per fallback interval and one more per stop-poll (_POLL_S), with room to spare
    per_s = 1.0 / notices_module.NOTICE_FALLBACK_S + 1.0 / receiver_module._POLL_S
    assert idle_checks <= 1.5 * per_s, idle_checks
    assert env.broadcaster.publish(2, tiny_model(2)).delivered
    assert wait_version(receiver, 2).version == 2


def test_every_write_a_receiver_waits_for_sends_a_notice(env_factory, monkeypatch):
    """With the fallback and the stop-poll at 30 s, only notices wake a receiver: a new epoch
    (announcement, commit), the weights' announcement and their checksums must each send one,
    or the publish (10 s timeout) is not delivered."""
    env = env_factory()
    model = tiny_model()
    env.broadcaster.publish(0, model)
    staying, leaving = env.receiver("rollout-0"), env.receiver("rollout-1")
    env.wait_members(2)
    assert env.broadcaster.publish(1, model).delivered
    wait_version(staying, 1)
    leaving.stop()  # LEAVE: the next publish forms a new epoch without it
    wait_until(lambda: env.broadcaster.membership.registered() == 1, 10, "rollout-1 gone")
    monkeypatch.setattr(notices_module, "NOTICE_FALLBACK_S", 30.0)
    monkeypatch.setattr(receiver_module, "_POLL_S", 30.0)
    time.sleep(0.5)  # not a wait: the receiver's store wait begun under the old values ends
    stats = env.broadcaster.publish(2, tiny_model(2))
    assert stats.delivered and stats.members == 1
    assert wait_version(staying, 2, timeout_s=10).version == 2
    assert staying.error is None


def test_with_curve_only_the_runs_clients_hear_the_notices(tmp_path):
    """`security.curve`: the PUB socket is a CURVE server like the snapshot server; a
    listener without the run's client keys hears nothing (and would fall back to the store)."""
    keys = generate_keys(tmp_path / "keys")
    security = SecurityConfig(curve=True, keys_dir=str(keys.directory))
    server, client = secure_context(security, "server"), secure_context(security, "client")
    assert server is not None and client is not None
    plain_ctx = zmq.Context()
    publisher = NoticePublisher(server, "127.0.0.1")
    listener, plain = (
        NoticeListener(client, publisher.endpoint),
        NoticeListener(plain_ctx, publisher.endpoint),
    )
    try:
        assert notices_through(publisher, listener, 10)
        assert not notices_through(publisher, plain, 1)
    finally:
        for sock in (listener, plain, publisher):
            sock.close()
        for ctx in (server, client, plain_ctx):
            ctx.term()
