"""ACKs of a trained step sent off the training thread.

With checkpoints off, a step's leases are ACKed right after it trains (learner/leases.py says
why then). Sent from the training thread, each ACK is a round trip to a shard the training
thread waits on: py-spy put it at 2.4% of the learner's wall time on the vs_trl workload (about
1 ms a step; a shard at nice 10 shares its core with the rollouts). Here one worker thread
with its own buffer client sends them while the next step trains; the ledger keeps the step's
ids held (`LeaseLedger.in_flight`) until the training thread applies the outcome, so a
redelivered copy is never trained meanwhile. One step's ACKs are in flight at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from sluice.buffer.client import BufferClient
from sluice.learner.leases import LeaseLedger, StepLeases, ack_steps

log = logging.getLogger(__name__)


class BackgroundAcks:
    """Owns the worker and its client; every ledger change happens on the caller's thread."""

    def __init__(self, ledger: LeaseLedger, make_client: Callable[[], BufferClient]) -> None:
        self.ledger = ledger
        self._make_client = make_client
        self._client: BufferClient | None = None  # made, used and closed on the worker only
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lease-acks")
        self._inflight: tuple[list[StepLeases], Future] | None = None

    def send(self) -> list[str]:
        """Apply the ACKs in flight (waiting for them if need be), then send the ledger's pending
        steps' ACKs. Returns the ids that lost their lease in the steps applied."""
        lost = self.collect()
        steps = self.ledger.detach()
        if steps:
            self._inflight = (steps, self._pool.submit(self._ack, steps))
        return lost

    def collect(self) -> list[str]:
        """Wait for the ACKs in flight and apply them to the ledger. Returns the ids that lost
        their lease. An ACK that failed for another reason raises here, its steps pending again."""
        if self._inflight is None:
            return []
        steps, future = self._inflight
        self._inflight = None
        try:
            acks = future.result()
        except BaseException:
            self.ledger.undo(steps)
            raise
        return self.ledger.apply(steps, acks)[1]

    def close(self) -> None:
        """Collect what is in flight, then stop the worker and close its client. A failed ACK
        is logged, not raised: its leases expire at their shards and are delivered again."""
        try:
            self.collect()
        except Exception as e:  # noqa: BLE001 - closing; the steps are pending again
            log.warning("ACKs in flight at close failed: %s", e)
        finally:
            if self._client is not None:  # nothing in flight now: the worker is idle
                self._pool.submit(self._close_client).result()
            self._pool.shutdown(wait=True)

    def _ack(self, steps: list[StepLeases]) -> list[tuple[int, bool]]:
        if self._client is None:
            self._client = self._make_client()
        return ack_steps(self._client, steps)

    def _close_client(self) -> None:
        assert self._client is not None
        self._client.close()
        self._client = None
