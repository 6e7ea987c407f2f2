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
from sluice.net import zmq_socket
from sluice.security import generate_keys, secure_context
from sluice.weight_sync.notices import NoticeListener, NoticePublisher


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(50, 24), torch.nn.Linear(24, 50))


class CountingStore:
    """A receiver's store that counts the lookups (`check`) made through it and lists the keys
    it was asked for (`check` and `get`)."""

    def __init__(self, store) -> None:
        self._store = store
        self.checks = 0
        self.checked: list[str] = []
        self.got: list[str] = []

    def check(self, keys):
        self.checks += 1
        self.checked += keys
        return self._store.check(keys)

    def get(self, key):
        self.got.append(key)
        return self._store.get(key)

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


def carried_after_a_wait(listener: NoticeListener, key: str) -> bool:
    """Take what notices came (waiting 50 ms at most), then say whether `key`'s value is kept."""
    listener.wait(0.05)
    return listener.carried(key) is not None


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


def test_a_listener_keeps_the_newest_values_notices_carry(zmq_ctx):
    """A notice with a key carries the value the key holds now: the listener keeps the newest
    per key, CARRIED_KEEP keys at most (the oldest go first); a bare notice carries none."""
    publisher = NoticePublisher(zmq_ctx, "127.0.0.1")
    listener = NoticeListener(zmq_ctx, publisher.endpoint)
    try:
        assert notices_through(publisher, listener, 10)
        publisher.notify("ws/ann/0/sums", b"A" * 8)
        publisher.notify("ws/ann/0/sums", b"A" * 16)  # appended: the whole value again
        for seq in range(1, notices_module.CARRIED_KEEP + 1):
            publisher.notify(f"ws/ann/{seq}", f"announcement {seq}".encode())
        publisher.notify()
        last = f"ws/ann/{notices_module.CARRIED_KEEP}"
        wait_until(lambda: carried_after_a_wait(listener, last), 10, "the notices")
        assert listener.carried(last) == f"announcement {notices_module.CARRIED_KEEP}".encode()
        assert listener.carried("ws/ann/1") == b"announcement 1"
        assert listener.carried("ws/ann/0/sums") is None  # the oldest of CARRIED_KEEP + 1 keys
        assert listener.carried("") is None and listener.carried("ws/head") is None
    finally:
        listener.close()
        publisher.close()


def test_a_listener_ignores_notices_of_another_shape(zmq_ctx):
    """A frame this version does not know (three parts, one part, an empty key) wakes the
    listener like a bare notice and is not kept; the listener goes on."""
    pub = zmq_socket(zmq_ctx, zmq.PUB, hwm=64)
    endpoint = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
    listener = NoticeListener(zmq_ctx, endpoint)
    try:
        deadline = time.monotonic() + 10
        while not listener.wait(0.05):  # until the subscription is up
            assert time.monotonic() < deadline, "no notice heard"
            pub.send_multipart([b"", b""])
        for frames in ([b"k", b"v", b"extra"], [b"k"], [b"", b"v"], [b"\xff\xfe", b"v"]):
            pub.send_multipart(frames)
        pub.send_multipart([b"k2", b"v2"])
        wait_until(lambda: carried_after_a_wait(listener, "k2"), 10, "k2")
        assert listener.carried("k2") == b"v2"
        assert listener.carried("k") is None
    finally:
        listener.close()
        pub.close(linger=0)


def member_at_version_1(env_factory):
    """A learner's weight-sync side and one member that took version 1 (notices carry values
    from then on)."""
    env = env_factory()
    env.broadcaster.publish(0, tiny_model())
    receiver = env.receiver("rollout-0")
    env.wait_members(1)
    assert env.broadcaster.publish(1, tiny_model(1)).delivered
    wait_version(receiver, 1)
    return env, receiver


def test_a_member_takes_a_version_from_the_notices_alone(env_factory, monkeypatch):
    """The announcement and its checksums come in the notices that follow their writes: a
    member reads neither from the store (each read is a round trip on the path from a
    publish to the first generation on it). With the fallback at 30 s the store is not
    looked at while notices come; the fallback itself: the next test."""
    monkeypatch.setattr(notices_module, "NOTICE_FALLBACK_S", 30.0)
    env, receiver = member_at_version_1(env_factory)
    store = CountingStore(receiver._store)
    receiver._store = store
    for version in (2, 3):
        assert env.broadcaster.publish(version, tiny_model(version)).delivered
        assert wait_version(receiver, version).version == version
    read = [key for key in store.got if key.startswith("ws/ann/")]
    read += [key for key in store.checked if key.endswith("/sums")]
    assert read == [], read
    assert receiver.error is None


def test_without_carried_values_a_member_reads_the_store(env_factory, monkeypatch):
    """Notices that stop carrying values (lost, or bare): the member looks at the store every
    NOTICE_FALLBACK_S, reads the announcement and the checksums there and takes the version
    all the same."""
    env, receiver = member_at_version_1(env_factory)
    publisher = env.broadcaster.notices
    assert publisher is not None
    bare = publisher.notify
    monkeypatch.setattr(publisher, "notify", lambda key="", value=b"": bare())
    store = CountingStore(receiver._store)
    receiver._store = store
    assert env.broadcaster.publish(2, tiny_model(2)).delivered
    assert wait_version(receiver, 2).version == 2
    assert any(key.startswith("ws/ann/") and key.endswith("/sums") for key in store.got)
    assert receiver.error is None
