"""A rollout service's side of a grant made on weights announced to its receiver but not yet
reported verified by it (`AdmitReply.ahead`): it takes those weights before it generates, so
what it makes is of the version the grant was counted on. The control server, its admission
policy and the weight-sync membership are the real ones; the service's producer and weight feed
are small stand-ins that record what the actor loop does with them."""

from __future__ import annotations

import threading
import time
from typing import Any, cast

from sluice.buffer.client import BufferClient
from sluice.config.loader import config_from_dict
from sluice.control.client import ControlClient
from sluice.metrics import PrometheusEndpoint
from sluice.rollout_svc.actor import ActorConnections, ActorLoop, PolicyLink
from sluice.rollout_svc.engines.base import WeightUpdate
from sluice.weight_sync.membership import Membership

ARRIVES_AFTER_S = 0.3  # the announced weights reach the service's receiver this long after


class LoadsWeights:
    """The producer's weights side: which version it holds, and when each was loaded."""

    policy_id = "default"
    group_prefix = ""

    def __init__(self) -> None:
        self.version = 0
        self.loaded_at: dict[int, float] = {}

    def version_of(self, policy: str) -> int:
        return self.version

    def load_weights(self, policy: str, update: WeightUpdate) -> None:
        self.version = update.version
        self.loaded_at[update.version] = time.monotonic()

    def close(self) -> None: ...


class ArrivingFeed:
    """A receiver's feed that has version 1 from `ARRIVES_AFTER_S` after `announce()`."""

    member = "rollout-0"
    done = False
    error = None

    def __init__(self) -> None:
        self._arrived = threading.Event()
        self._taken = False

    def announce(self) -> None:
        threading.Timer(ARRIVES_AFTER_S, self._arrived.set).start()

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def observe(self, version: int) -> None: ...

    def poll(self) -> WeightUpdate | None:
        if not self._arrived.is_set() or self._taken:
            return None
        self._taken = True
        return WeightUpdate(1, [])

    def wait(self, timeout_s: float) -> WeightUpdate | None:
        self._arrived.wait(timeout_s)
        return self.poll()


class NoBuffer:
    """Nothing is PUT here; the loop only closes its buffer client."""

    def close(self) -> None: ...


def _actor(tmp_path, control: ControlClient, feed: ArrivingFeed, producer: LoadsWeights) -> ActorLoop:
    cfg = config_from_dict(
        {
            "run": {"dir": str(tmp_path)},
            "model": {"init": {"vocab": "digits"}},
            "task": {"name": "copy", "params": {"length": 3}},
            "buffer": {"endpoints": ["tcp://127.0.0.1:1"]},  # never dialled here
            "learner": {"batch_size": 8, "max_staleness": 0},
        }
    )
    link = PolicyLink("default", cast(Any, feed), control)
    conn = ActorConnections({"default": link}, cast(BufferClient, NoBuffer()), PrometheusEndpoint(), None)
    return ActorLoop(cfg, 0, threading.Event(), cast(Any, producer), conn, wait_for_published=False)


def test_a_grant_ahead_of_the_services_report_waits_for_its_weights(tmp_path, control):
    """Batch 8, max_staleness 0: v0's quota is used, the service long-polls for more, the
    learner announces v1 to the epoch the service is a member of. The grant comes at once, on
    v1, ahead of any report; the service returns it only once v1 has arrived and is loaded
    (not generating on v0 under v1's quota), though `wait_for_published` is off."""
    server, client = control
    membership = Membership()
    server.attach_membership(membership)
    client.join("rollout-0", "inc-a", 0)
    _, _, candidates = membership.begin_epoch()
    membership.commit_epoch(candidates, dropped=[])
    assert client.admit("other", 8, 4).granted == 8  # v0's quota used up
    producer, feed = LoadsWeights(), ArrivingFeed()
    actor = _actor(tmp_path, ControlClient(server.endpoint, timeout_s=5), feed, producer)
    granted: list[tuple[int, float]] = []

    def admit() -> None:
        granted.append((actor._admit_one(actor.links["default"], 8, 4), time.monotonic()))

    thread = threading.Thread(target=admit, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server._parked and time.monotonic() < deadline:
            time.sleep(0.005)
        assert server._parked, "the ADMIT did not park"
        announced = time.monotonic()
        membership.next_seq(1)
        feed.announce()
        thread.join(timeout=10)
    finally:
        actor.close()  # and its control client
    assert granted and granted[0][0] == 8
    assert producer.version == 1 and producer.loaded_at[1] - announced >= ARRIVES_AFTER_S * 0.9
    assert granted[0][1] >= producer.loaded_at[1]
