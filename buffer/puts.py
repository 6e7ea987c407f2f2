"""The producer side of the client: trajectories packed as whole groups into PUT messages,
sent to their shards (as frames, or through shared memory: `same_host_client.py`), and retried
until every group is stored or the client gives up; and the two ways to PUT without waiting on
each reply, `PutPipeline` (replies awaited later) and `PutBatcher` (small PUTs collected).
The rules (idempotent retries, pins, backpressure) and why: docs/architecture.md, Buffer.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeGuard

from sluice.buffer.link import Call, Lost, NotSent, ShardLink, wait_all, wait_out
from sluice.buffer.placement import OutGroup, Placement, ShardUnavailable
from sluice.buffer.same_host_client import SameHostPuts, Sent, refused_region
from sluice.rpc import RpcError
from sluice.trajectory import Trajectory
from sluice.wire.messages import PROTO_VERSION, PutReply, PutRequest

log = logging.getLogger(__name__)


class PutAborted(RuntimeError):
    """`should_abort` turned true while a PUT was waiting out backpressure or a down shard."""


@dataclass(frozen=True)
class PutSettings:
    """How a client PUTs (BufferClient's arguments of the same names)."""

    timeout_s: float  # for each PUT (and RESERVE) request
    put_give_up_s: float  # a PUT is retried until then, and then raises
    should_abort: Callable[[], bool]  # checked while a PUT waits to be retried: PutAborted
    max_batch: int  # trajectories in one PUT message (the shards' buffer.max_batch)
    max_message_bytes: int  # the shards' buffer.max_message_bytes
    put_message_bytes: int  # payload bytes one PUT message carries (more: several messages)
    same_host_min_put_bytes: int | None  # smaller PUTs carry frames; None: each shard's advice


class PutSender:
    """Sends PUTs for one client and retries them (not thread-safe, like the client)."""

    def __init__(self, links: Sequence[ShardLink], placement: Placement, settings: PutSettings) -> None:
        self.links = links
        self.placement = placement
        self.settings = settings
        least = settings.same_host_min_put_bytes
        self.shared = SameHostPuts(links, settings.timeout_s, least, self.send_frames)
        self.backpressure_s = 0.0  # total time spent waiting on full shards

    def put(self, trajs: Sequence[Trajectory]) -> PutReply:
        """Store `trajs` (whole groups), retrying until each group is stored (see BufferClient.put)."""
        total = PutReply(proto=PROTO_VERSION, id=0)
        self.put_groups(self.out_groups(trajs), total)
        return total

    def put_groups(self, todo: list[OutGroup], total: PutReply) -> None:
        """Send `todo` and retry what fails until every group is stored (or give up: raise)."""
        give_up = time.monotonic() + self.settings.put_give_up_s
        while todo:
            sent = self.send(self.plan_messages(todo))
            wait_all([call for _, call in sent], self.links)
            todo, wait_s, last_error = self.harvest(sent, total)
            if todo:
                self._wait_before_retry(wait_s, give_up, last_error)

    def harvest(
        self, sent: Sequence[Sent], total: PutReply
    ) -> tuple[list[OutGroup], float, BaseException | None]:
        """Account for finished PUTs: add what they stored to `total`, keep the regions their
        shards reserved for our next PUTs. Returns the groups to send again, how long to wait
        first, and the last error; raises errors no retry can fix."""
        todo: list[OutGroup] = []
        wait_s, last_error = 0.0, None
        for groups, call in sent:
            if call.error is None:
                total.accepted += call.reply.accepted
                total.duplicates += call.reply.duplicates
                for g in groups:
                    self.placement.pin(g)
                self.shared.keep_next_region(call)
                continue
            last_error = call.error
            todo.extend(groups)
            if refused_region(call):  # (a bug, somewhere): the same PUT with frames
                log.warning("%s: %s; sending it as frames", self.links[groups[0].shard].name, call.error)
                for g in groups:
                    g.frames_only = True
            elif _is_full(call.error):
                wait_s = max(wait_s, call.error.retry_after_ms / 1000.0)
            elif isinstance(call.error, Lost):
                for g in groups:
                    self.placement.pin(g)
                wait_s = max(wait_s, self.placement.retry_delay(groups))
            elif isinstance(call.error, NotSent) or (
                isinstance(call.error, RpcError) and call.error.code == "UNAVAILABLE"
            ):
                wait_s = max(wait_s, self.placement.retry_delay(groups))
            else:
                raise call.error  # a request the shard will never take (BAD_HEADER, TOO_LARGE...)
        return todo, wait_s, last_error

    def out_groups(self, trajs: Sequence[Trajectory]) -> list[OutGroup]:
        """`trajs` as groups for the wire; raises ValueError for a group no PUT can carry."""
        limits = self.settings
        groups: dict[str, OutGroup] = {}
        for t in trajs:
            meta, frames = t.to_wire()
            g = groups.get(t.group_id)
            if g is None:
                g = groups[t.group_id] = OutGroup(t.group_id, [], 0)
            g.wire.append((meta, frames))
            g.nbytes += t.nbytes
        for g in groups.values():
            if g.nbytes > limits.max_message_bytes - (1 << 20):
                raise ValueError(
                    f"group {g.group_id!r}: {g.nbytes} payload bytes cannot fit one message "
                    f"(buffer.max_message_bytes={limits.max_message_bytes})"
                )
            if len(g.wire) > limits.max_batch:
                raise ValueError(
                    f"group {g.group_id!r}: {len(g.metas)} trajectories > buffer.max_batch {limits.max_batch}"
                )
        return list(groups.values())

    def plan_messages(self, todo: list[OutGroup]) -> list[list[OutGroup]]:
        """Route the groups, then pack each shard's into PUT messages that respect max_batch
        and put_message_bytes."""
        most_trajs, most_bytes = self.settings.max_batch, self.settings.put_message_bytes
        messages = []
        for groups in self.placement.route(todo, time.monotonic()).values():
            current: list[OutGroup] = []
            n = nbytes = 0
            for g in groups:
                if current and (n + len(g.wire) > most_trajs or nbytes + g.nbytes > most_bytes):
                    messages.append(current)
                    current, n, nbytes = [], 0, 0
                current.append(g)
                n += len(g.wire)
                nbytes += g.nbytes
            messages.append(current)
        return messages

    def send(self, messages: list[list[OutGroup]]) -> list[Sent]:
        """Send every message: through shared memory where its shard is on this host and it is
        worth it, else with frames."""
        sent: list[Sent] = []
        shared = []
        for groups in messages:
            link = self.links[groups[0].shard]
            link.pump_events()
            if self.shared.wants(link, groups):
                shared.append(groups)
            else:
                sent.append((groups, self.send_frames(groups)))
        if shared:
            sent += self.shared.send(shared)
        return sent

    def send_frames(self, groups: list[OutGroup]) -> Call:
        """A PUT of `groups` (on one shard) carrying its arrays as ZeroMQ frames."""
        link = self.links[groups[0].shard]
        header = PutRequest(
            proto=PROTO_VERSION, id=link.next_id(), trajs=[m for g in groups for m in g.metas]
        )
        call = Call(header, [f for g in groups for f in g.frames], self.settings.timeout_s)
        link.send(call)
        return call

    def _wait_before_retry(self, wait_s: float, give_up: float, error: BaseException | None) -> None:
        """Sleep `wait_s` (checking `should_abort`), or raise if that would pass `give_up`."""
        if time.monotonic() + wait_s > give_up:
            if isinstance(error, RpcError):
                raise error
            waited = self.settings.put_give_up_s
            raise ShardUnavailable(f"PUT gave up after {waited:.1f}s: {error}") from error
        if wait_out(wait_s, self.settings.should_abort):
            raise PutAborted("PUT abandoned on request")
        if _is_full(error):
            self.backpressure_s += wait_s


def _is_full(error: BaseException | None) -> TypeGuard[RpcError]:
    return isinstance(error, RpcError) and error.code == "FULL"


class PutPipeline:
    """PUTs that do not wait for their replies: `put` sends and returns while up to `window`
    PUT messages are in flight (it waits for the oldest beyond that), so a producer prepares
    (same host: writes) its next PUT while the shard checks and logs the last one. Every reply
    is still awaited: those of PUTs that fail are sent again (as `BufferClient.put` does:
    FULL, a down shard, a lost reply; pinned where they may have gone), synchronously.

    A trajectory is acknowledged by the buffer only once the PUT carrying it was answered:
    what a `put` call returns counts the PUTs answered during it (maybe earlier calls'), and
    `flush()` (or leaving the `with` block) waits for every one. If the producer dies before,
    PUTs not yet answered may or may not be stored (a resend is deduped). Not thread-safe;
    flush before closing the client."""

    def __init__(self, sender: PutSender, window: int) -> None:
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
        self.sender = sender
        self.window = window
        self.in_flight: deque[Sent] = deque()

    def put(self, trajs: Sequence[Trajectory]) -> PutReply:
        """Send `trajs`; return once at most `window` PUT messages are unanswered, with the
        counts of those answered meanwhile."""
        sender = self.sender
        total = PutReply(proto=PROTO_VERSION, id=0)
        self._settle_done(total)
        self.in_flight.extend(sender.send(sender.plan_messages(sender.out_groups(trajs))))
        self._settle(total, keep=self.window)
        return total

    def flush(self) -> PutReply:
        """Wait until every PUT sent is answered (and, if it failed, stored by a retry)."""
        total = PutReply(proto=PROTO_VERSION, id=0)
        self._settle(total, keep=0)
        return total

    def _settle(self, total: PutReply, keep: int) -> None:
        while len(self.in_flight) > keep:
            wait_all([self.in_flight[0][1]], self.sender.links)
            self._settle_done(total)

    def _settle_done(self, total: PutReply) -> None:
        """Account for the finished PUTs (in any order); retry the failed ones to the end."""
        done = [sent for sent in self.in_flight if sent[1].done]
        if not done:
            return
        self.in_flight = deque(sent for sent in self.in_flight if not sent[1].done)
        retries = [self.sender.harvest([sent], total)[0] for sent in done]
        for retry in retries:  # (each as it was sent: together they might not fit the shard)
            if retry:
                self.sender.put_groups(retry, total)

    def __enter__(self) -> PutPipeline:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.flush()


class PutBatcher:
    """Producer-side batching: collects whole groups from many small `add` calls and PUTs them
    together once `max_trajs` trajectories or `max_bytes` payload bytes are waiting, or the
    oldest has waited `linger_s` (checked at each `add`; there is no background thread).

    A trajectory is acknowledged by the buffer only when the PUT carrying it returns: when an
    `add` returns a PutReply, or at `flush()` / leaving the `with` block. Until then it lives
    only in this process. Not thread-safe."""

    def __init__(self, sender: PutSender, *, max_trajs: int, max_bytes: int, linger_s: float) -> None:
        self.sender = sender
        self.max_trajs = max_trajs
        self.max_bytes = max_bytes
        self.linger_s = linger_s
        self.pending: list[Trajectory] = []
        self.pending_bytes = 0
        self.first_at = 0.0

    def add(self, trajs: Sequence[Trajectory]) -> PutReply | None:
        if not self.pending:
            self.first_at = time.monotonic()
        self.pending.extend(trajs)
        self.pending_bytes += sum(t.nbytes for t in trajs)
        if (
            len(self.pending) >= self.max_trajs
            or self.pending_bytes >= self.max_bytes
            or time.monotonic() - self.first_at >= self.linger_s
        ):
            return self.flush()
        return None

    def flush(self) -> PutReply:
        if not self.pending:
            return PutReply(proto=PROTO_VERSION, id=0)
        reply = self.sender.put(self.pending)
        self.pending, self.pending_bytes = [], 0
        return reply

    def __enter__(self) -> PutBatcher:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.flush()
