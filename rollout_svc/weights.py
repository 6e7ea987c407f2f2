"""Where a rollout service's new weights come from: a `WeightFeed`.

- `ReceiverFeed`: the weight-sync receiver (a thread in the broadcast group; weight_sync/ owns
  it). Used by every engine with a model (hf, vllm).
- `VersionFeed`: versions only, learned from the control plane's replies (the newest
  published version rides on every ADMIT reply). Used by the sim engine, which has no
  weights, so simulated services need no torch and no broadcast-group membership.
"""

from __future__ import annotations

import threading
from typing import Protocol

import zmq

from sluice.config.run import RunConfig
from sluice.rollout_svc.engines.base import WeightUpdate


class WeightFeed(Protocol):
    def start(self) -> None: ...

    def poll(self) -> WeightUpdate | None:
        """The newest version not yet taken, or None (never blocks)."""
        ...

    def wait(self, timeout_s: float) -> WeightUpdate | None:
        """Like poll, but waits up to timeout_s for one."""
        ...

    @property
    def done(self) -> bool:
        """No more weights will come: the learner announced shutdown, or the feed failed."""
        ...

    @property
    def error(self) -> BaseException | None: ...

    def observe(self, version: int) -> None:
        """The control plane says weights of `version` are published."""

    @property
    def member(self) -> str:
        """The weight-sync service id its receiver JOINed as ("": no receiver): ADMITs name it."""
        ...

    def stop(self) -> None: ...


class ReceiverFeed:
    """Adapts `weight_sync.receiver.WeightReceiver` (its tensors are named views of the
    received buckets)."""

    def __init__(self, receiver) -> None:
        self.receiver = receiver

    def start(self) -> None:
        self.receiver.start()

    def poll(self) -> WeightUpdate | None:
        return _update(self.receiver.take_latest())

    def wait(self, timeout_s: float) -> WeightUpdate | None:
        return _update(self.receiver.wait_for_weights(timeout_s=timeout_s))

    @property
    def done(self) -> bool:
        return self.receiver.finished.is_set()

    @property
    def error(self) -> BaseException | None:
        return self.receiver.error

    def observe(self, version: int) -> None:
        """The receiver learns versions from the broadcast itself."""

    @property
    def member(self) -> str:
        return self.receiver.service_id

    def stop(self) -> None:
        self.receiver.stop()


def receiver_feed(cfg: RunConfig, service_id: str, zmq_ctx: zmq.Context | None) -> ReceiverFeed:
    """A weight-sync receiver for service `service_id` (torch is imported only here)."""
    import torch

    from sluice.weight_sync.receiver import WeightReceiver

    receiver = WeightReceiver(
        cfg.weight_sync,
        service_id=service_id,
        device=torch.device("cpu"),
        control_endpoint=cfg.control.endpoint,
        zmq_ctx=zmq_ctx,
    )
    return ReceiverFeed(receiver)


def _update(received) -> WeightUpdate | None:
    return None if received is None else WeightUpdate(received.version, received.tensors)


class VersionFeed:
    """Versions without tensors, fed by `observe` from control-plane replies."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._published = -1
        self._taken = -1
        self._stopped = False

    def start(self) -> None:
        pass

    @property
    def member(self) -> str:
        return ""  # no receiver: grants follow the published version

    def observe(self, version: int) -> None:
        with self._cond:
            if version > self._published:
                self._published = version
                self._cond.notify_all()

    def poll(self) -> WeightUpdate | None:
        with self._cond:
            return self._take()

    def wait(self, timeout_s: float) -> WeightUpdate | None:
        with self._cond:
            self._cond.wait_for(lambda: self._published > self._taken or self._stopped, timeout=timeout_s)
            return self._take()

    def _take(self) -> WeightUpdate | None:
        if self._published <= self._taken:
            return None
        self._taken = self._published
        return WeightUpdate(self._published, [])

    @property
    def done(self) -> bool:
        return self._stopped

    @property
    def error(self) -> BaseException | None:
        return None

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
