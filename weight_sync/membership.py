"""Who receives weights: learner rank 0's registry of weight-sync members.

A rollout service's receiver JOINs (over the control plane) after it pulled the current
version, and is *pending* until the learner's next membership epoch lists it; once it
confirmed that epoch it is a *member* of the group. LEAVE removes it; a candidate that does not
confirm an epoch in time is dropped and must JOIN again. Any change makes the broadcaster form
a new epoch (a new group under a new store prefix) before its next publish.

Thread rules: the control server thread calls `handle` and `status`; the learner thread (the
broadcaster) calls the rest. One lock guards everything. The announcement sequence number
lives here, under the same lock, so that the `seq` in a JOIN reply is never past the epoch
announcement that lists the joiner: candidates are chosen and that announcement's number is
reserved in one step. Likewise the shutdown announcement's: a JOIN answered after it is
told the learner is shutting down (it would otherwise wait for announcements past the last).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Literal

from sluice.control.messages import (
    JoinReply,
    JoinRequest,
    LeaveReply,
    LeaveRequest,
    MemberSyncStatus,
    SyncReportReply,
    SyncReportRequest,
    WeightSyncStatus,
)
from sluice.wire.messages import PROTO_VERSION


@dataclass
class Member:
    service_id: str
    incarnation: str
    held_version: int  # what it said it holds when it joined
    device: str = "cpu"  # device type its weights land on
    state: Literal["pending", "member"] = "pending"
    version: int = -1  # last version it reported verified
    refused: int = 0
    failed: int = 0
    last_error: str = ""
    report: tuple[int, int, str] | None = None  # (epoch, version, outcome) last reported
    pid: int = 0  # the receiver's process, as its JOIN said (0: not said)


@dataclass(frozen=True)
class Candidate:
    service_id: str
    incarnation: str
    device: str = "cpu"


class Membership:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reported = threading.Condition(self._lock)
        self._members: dict[str, Member] = {}
        self._changed = False
        self._seq = 0
        self.epoch = 0
        self.published_version = -1
        self.announced_version = -1
        self.shutting_down = False  # the shutdown announcement's seq is taken: JOINs are turned away
        self._problems: list[SyncReportRequest] = []
        self.counters: Counter[str] = Counter()
        self._on_announce: Callable[[], None] = lambda: None

    # -- control-server thread -----------------------------------------------------------------

    def handle(self, req: JoinRequest | LeaveRequest | SyncReportRequest):
        with self._lock:
            if isinstance(req, JoinRequest):
                return self._join(req)
            if isinstance(req, LeaveRequest):
                return self._leave(req)
            return self._report(req)

    def _join(self, req: JoinRequest) -> JoinReply:
        if not req.service_id or not req.incarnation:
            raise ValueError("service_id and incarnation must not be empty")
        if "/" in req.service_id:
            raise ValueError(f"service_id={req.service_id!r} must not contain '/'")
        if self.shutting_down:
            self.counters["joins_after_shutdown"] += 1
            return JoinReply(proto=PROTO_VERSION, id=req.id, seq=self._seq, shutting_down=True)
        old = self._members.get(req.service_id)
        member = Member(req.service_id, req.incarnation, req.held_version, req.device, pid=req.pid)
        if old is not None:
            if old.incarnation != req.incarnation:
                self.counters["replaced"] += 1  # a restarted service: the old process is gone
            member.refused, member.failed, member.last_error = old.refused, old.failed, old.last_error
        self._members[req.service_id] = member
        self._changed = True
        self.counters["joins"] += 1
        return JoinReply(
            proto=PROTO_VERSION,
            id=req.id,
            seq=self._seq,
            epoch=self.epoch,
            published_version=self.published_version,
            announced_version=self.announced_version,
        )

    def _leave(self, req: LeaveRequest) -> LeaveReply:
        """By the receiver (its incarnation) or by a launcher that saw its process die (pid)."""
        if bool(req.incarnation) == (req.pid > 0):
            raise ValueError(
                f"LEAVE of {req.service_id!r}: give incarnation (a receiver) or pid > 0 (a launcher), "
                f"not both or neither (incarnation={req.incarnation!r}, pid={req.pid})"
            )
        counter = "leaves" if req.incarnation else "gone"
        removed = self._remove(req.service_id, counter, incarnation=req.incarnation, pid=req.pid)
        self._changed |= removed
        return LeaveReply(proto=PROTO_VERSION, id=req.id, removed=removed)

    def _report(self, req: SyncReportRequest) -> SyncReportReply:
        member = self._named(req.service_id, incarnation=req.incarnation)
        if member is not None:
            member.report = (req.epoch, req.version, req.outcome)
            self._reported.notify_all()
            if req.outcome == "ok":
                member.version = max(member.version, req.version)
            else:
                member.last_error = req.error
                if req.outcome == "refused":
                    member.refused += 1
                else:
                    member.failed += 1
                self._problems.append(req)
        if req.outcome != "ok":
            self.counters[f"receiver_{req.outcome}"] += 1
        return SyncReportReply(proto=PROTO_VERSION, id=req.id)

    def status(self) -> WeightSyncStatus:
        with self._lock:
            return WeightSyncStatus(
                epoch=self.epoch,
                published_version=self.published_version,
                members={
                    m.service_id: MemberSyncStatus(m.state, m.version, m.refused, m.failed, m.last_error)
                    for m in self._members.values()
                },
                counters={k: float(v) for k, v in self.counters.items()},
            )

    # -- learner thread ------------------------------------------------------------------------

    def next_seq(self, version: int = -1) -> int:
        """The next announcement's seq; `version`: the weights it announces (-1: none). A newer
        version calls the `watch_announcements` callback (admission may grant on it)."""
        with self._lock:
            newer = version > self.announced_version
            self.announced_version = max(self.announced_version, version)
            seq = self._take_seq()
        if newer:
            self._on_announce()
        return seq

    def shutdown_seq(self) -> int:
        """The shutdown announcement's seq; every JOIN from now on is answered `shutting_down`."""
        with self._lock:
            self.shutting_down = True
            return self._take_seq()

    def _take_seq(self) -> int:
        """Reserve the next announcement's seq (the caller holds the lock)."""
        seq = self._seq
        self._seq += 1
        return seq

    def needs_epoch(self) -> bool:
        with self._lock:
            return self._changed

    def begin_epoch(self, leave_out: Collection[Candidate] = ()) -> tuple[int, int, list[Candidate]]:
        """(announcement seq, new epoch, candidates in rank order): every registered service
        but those in `leave_out` (members whose heartbeat stopped in the failed epoch), which are
        forgotten now rather than waited for; they JOIN again if they come back."""
        with self._lock:
            for c in leave_out:
                self._forget(c)
            self.epoch += 1
            self._changed = False
            seq = self._take_seq()
            self.counters["epochs"] += 1
            return (
                seq,
                self.epoch,
                [Candidate(m.service_id, m.incarnation, m.device) for m in self._members.values()],
            )

    def commit_epoch(self, committed: list[Candidate], dropped: list[Candidate]) -> None:
        """Committed candidates become members; dropped ones are forgotten (they JOIN again).
        A candidate whose service joined again meanwhile (new incarnation) is left alone."""
        with self._lock:
            for c in committed:
                if (m := self._named(c.service_id, incarnation=c.incarnation)) is not None:
                    m.state = "member"
            for c in dropped:
                self._forget(c)

    def _forget(self, c: Candidate) -> None:
        """Drop candidate `c` unless its service joined again since (the caller holds the lock)."""
        self._remove(c.service_id, "dropped", incarnation=c.incarnation)

    def _remove(self, service_id: str, counter: str, *, incarnation: str = "", pid: int = 0) -> bool:
        """Remove `service_id` if it is still the member named by `incarnation` or `pid` (not a
        later JOIN of the same service); count it under `counter`. The caller holds the lock."""
        assert incarnation or pid > 0, "a removal names the member it means"
        if self._named(service_id, incarnation=incarnation or None, pid=pid) is None:
            return False
        del self._members[service_id]
        self.counters[counter] += 1
        return True

    def _named(self, service_id: str, *, incarnation: str | None = None, pid: int = 0) -> Member | None:
        """Member `service_id` if it is still the one `incarnation` and `pid` name (each only
        where given: None, 0), not a later JOIN of the same service; an empty incarnation names
        none (a member always has one). The caller holds the lock."""
        m = self._members.get(service_id)
        if (
            m is None
            or (incarnation is not None and m.incarnation != incarnation)
            or (pid > 0 and m.pid != pid)
        ):
            return None
        return m

    def watch_announcements(self, callback: Callable[[], None]) -> None:
        """`callback()` after each newer version is announced (from the announcing thread)."""
        self._on_announce = callback

    def admissible(self, service_id: str) -> int:
        """The weights version work admitted for `service_id` is generated with at least: the
        newest announced where it is a member of the current epoch (the announcement is sent
        to it, and its service takes those weights before it generates: `_catch_up` in
        rollout_svc/actor.py), else the newest it reported verified (-1: none, or unknown)."""
        with self._lock:
            m = self._members.get(service_id)
            if m is not None and m.state == "member":
                return max(self.announced_version, self.published_version)
        return self.verified(service_id)

    def verified(self, service_id: str) -> int:
        """The newest version `service_id`'s current incarnation reported verified (-1: none,
        or not a member); never above the newest version announced or published (a report
        cannot raise admission past what the learner sent)."""
        with self._lock:
            m = self._members.get(service_id)
            newest = max(self.announced_version, self.published_version)
            return min(m.version, newest) if m is not None else -1

    def holds(self, c: Candidate) -> bool:
        """Whether candidate `c` is still registered (no LEAVE, not replaced by a new incarnation)."""
        with self._lock:
            return self._named(c.service_id, incarnation=c.incarnation) is not None

    def wait_reports(
        self, epoch: int, version: int, service_ids: list[str], timeout_s: float
    ) -> dict[str, str]:
        """Outcome per member that reported `version` over `epoch` (a member that left counts
        as "left"); returns when all did, when one failed, or after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._reported:
            while True:
                got = {}
                for sid in service_ids:
                    m = self._members.get(sid)
                    if m is None:
                        got[sid] = "left"
                    elif m.report is not None and m.report[:2] == (epoch, version):
                        got[sid] = m.report[2]
                remaining = deadline - time.monotonic()
                if len(got) == len(service_ids) or "failed" in got.values() or remaining <= 0:
                    return got
                self._reported.wait(remaining)

    def take_problems(self) -> list[SyncReportRequest]:
        """Refusals and failures reported since the last call."""
        with self._lock:
            problems, self._problems = self._problems, []
            return problems

    def set_published(self, version: int) -> None:
        with self._lock:
            self.published_version = version
            self.counters["publishes"] += 1

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def registered(self) -> int:
        with self._lock:
            return len(self._members)
