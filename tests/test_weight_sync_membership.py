"""Weight-sync membership on the control plane: JOIN / LEAVE / SYNC_REPORT over real ZeroMQ."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from helpers.wait import wait_until

from sluice.control.client import ControlClient
from sluice.rpc import RpcError
from sluice.weight_sync.group import epoch_backend
from sluice.weight_sync.membership import Candidate, Membership

ROOT = Path(__file__).resolve().parents[1]

# `control` (a control server in a thread and a client of it) is a fixture of tests/conftest.py.


def test_membership_ops_need_an_attached_registry(control):
    _, client = control
    with pytest.raises(RpcError) as e:
        client.join("rollout-0", "a", -1)
    assert e.value.code == "BAD_HEADER" and "no weight-sync membership" in e.value.message
    assert client.status().weight_sync is None


def test_join_epoch_leave_and_reports(control):
    server, client = control
    membership = Membership()
    server.attach_membership(membership)
    reply = client.join("rollout-0", "inc-a", 3)
    assert reply.seq == 0 and reply.epoch == 0 and reply.published_version == -1
    client.join("rollout-1", "inc-b", -1)
    assert membership.needs_epoch()
    seq, epoch, candidates = membership.begin_epoch()  # what the broadcaster does at a publish
    assert (seq, epoch) == (0, 1) and [c.service_id for c in candidates] == ["rollout-0", "rollout-1"]
    assert not membership.needs_epoch()
    assert client.join("rollout-2", "inc-c", -1).seq == 1  # after the epoch announcement
    membership.commit_epoch([candidates[0]], dropped=[candidates[1]])  # rollout-1 did not confirm
    status = client.status().weight_sync
    assert status.epoch == 1
    assert {k: v.state for k, v in status.members.items()} == {"rollout-0": "member", "rollout-2": "pending"}
    client.sync_report("rollout-0", "inc-a", epoch=1, version=4, outcome="refused", error="checksum")
    client.sync_report("rollout-0", "inc-a", epoch=1, version=5, outcome="ok")
    client.sync_report("rollout-0", "", epoch=1, version=9, outcome="ok")  # names no incarnation: ignored
    problems = membership.take_problems()
    assert [(p.service_id, p.outcome, p.version) for p in problems] == [("rollout-0", "refused", 4)]
    member = client.status().weight_sync.members["rollout-0"]
    assert (member.version, member.refused, member.last_error) == (5, 1, "checksum")
    assert not client.leave("rollout-0", "stale-incarnation").removed  # a dead process's LEAVE
    assert client.leave("rollout-0", "inc-a").removed
    assert membership.needs_epoch() and membership.registered() == 1


def test_restarted_service_replaces_its_old_incarnation(control):
    server, client = control
    membership = Membership()
    server.attach_membership(membership)
    client.join("rollout-0", "old", 1)
    _, _, candidates = membership.begin_epoch()
    client.join("rollout-0", "new", 1)  # restarted while the epoch formed
    membership.commit_epoch(candidates, dropped=[])
    member = client.status().weight_sync.members["rollout-0"]
    assert member.state == "pending"  # the old incarnation's confirmation does not count
    assert membership.needs_epoch() and membership.counters["replaced"] == 1
    membership.commit_epoch([], dropped=[Candidate("rollout-0", "old")])
    assert membership.registered() == 1  # dropping the old one leaves the new one alone


def test_members_found_silent_are_left_out_of_the_next_epoch_unless_they_restarted(control):
    server, client = control
    membership = Membership()
    server.attach_membership(membership)
    for sid in ("rollout-0", "rollout-1", "rollout-2"):
        client.join(sid, "a", 1)
    _, _, candidates = membership.begin_epoch()
    membership.commit_epoch(candidates, dropped=[])
    client.join("rollout-2", "b", 1)  # rollout-2 died and its replacement joined already
    silent = [Candidate("rollout-1", "a"), Candidate("rollout-2", "a")]
    _, epoch, candidates = membership.begin_epoch(leave_out=silent)
    assert epoch == 2
    assert [(c.service_id, c.incarnation) for c in candidates] == [("rollout-0", "a"), ("rollout-2", "b")]
    assert set(client.status().weight_sync.members) == {"rollout-0", "rollout-2"}
    assert membership.counters["dropped"] == 1  # rollout-1; rollout-2's new incarnation stays


def test_a_launcher_leaves_a_dead_process_by_pid_and_never_its_replacement(control):
    server, client = control
    membership = Membership()
    server.attach_membership(membership)
    client.join("rollout-0", "a", 1, pid=4242)
    client.join("rollout-1", "b", 1, pid=4343)
    assert not client.leave("rollout-0", pid=9999).removed  # another process
    assert client.leave("rollout-0", pid=4242).removed
    assert membership.counters["gone"] == 1 and membership.needs_epoch()
    client.join("rollout-1", "c", 1, pid=5151)  # rollout-1 restarted: the old pid is not it any more
    assert not client.leave("rollout-1", pid=4343).removed
    assert set(client.status().weight_sync.members) == {"rollout-1"}
    for bad in ({"incarnation": "c", "pid": 5151}, {}):  # both, or neither
        with pytest.raises(RpcError) as e:
            client.leave("rollout-1", **bad)
        assert e.value.code == "BAD_HEADER" and "incarnation" in e.value.message and "pid" in e.value.message


def test_the_launcher_leaves_every_service_of_a_dead_rollout_process(control, tmp_path):
    from sluice.config.loader import load_config
    from sluice.launch.departed import leave_for_dead
    from sluice.launch.plan import plan_roles

    server, client = control
    membership = Membership()
    server.attach_membership(membership)
    port = int(server.endpoint.rsplit(":", 1)[1])
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [f"run.dir={tmp_path}", f"control.port={port}"])
    rollout = next(s for s in plan_roles(cfg) if s.kind == "rollout")
    client.join(rollout.name, "a", 1, pid=777)
    assert leave_for_dead(cfg, rollout, 776) == []  # not its process
    assert leave_for_dead(cfg, rollout, 777) == [f"default/{rollout.name}"]
    assert membership.registered() == 0
    shard = next(s for s in plan_roles(cfg) if s.kind == "buffer")
    assert leave_for_dead(cfg, shard, 777) == []  # only rollout services are members


def test_bad_membership_requests_are_named(control):
    server, client = control
    server.attach_membership(Membership())
    with pytest.raises(RpcError) as e:
        client.join("", "a", -1)
    assert e.value.code == "BAD_HEADER" and "service_id" in e.value.message
    with pytest.raises(RpcError) as e:
        client.sync_report("rollout-0", "a", epoch=1, version=1, outcome="maybe")
    assert e.value.code == "BAD_HEADER" and "outcome" in e.value.message
    assert client.join("rollout-0", "a", -1).ok  # still serving


def test_join_carries_the_device_the_epoch_backend_follows(control):
    server, client = control
    membership = Membership()
    server.attach_membership(membership)
    client.join("rollout-0", "a", -1, device="cuda")
    client.join("rollout-1", "b", -1)  # an older receiver says nothing: cpu
    _, _, candidates = membership.begin_epoch()
    assert [(c.service_id, c.device) for c in candidates] == [("rollout-0", "cuda"), ("rollout-1", "cpu")]


@pytest.mark.parametrize(
    ("configured", "learner", "members", "want"),
    [
        ("auto", "cpu", ["cpu", "cpu"], "gloo"),
        ("auto", "cuda", ["cuda", "cuda"], "nccl"),
        ("auto", "cuda", ["cuda", "cpu"], "gloo"),  # a CUDA learner with a CPU rollout service
        ("auto", "cuda", [], "nccl"),
        ("auto", "cpu", ["cuda"], "gloo"),  # a CPU learner (tests, small runs)
        ("auto", "npu", ["npu"], "hccl"),
        ("auto", "npu", ["cuda"], "gloo"),
        ("nccl", "cuda", ["cpu"], "nccl"),  # configured: used as is (and fails loudly if wrong)
        ("gloo", "cuda", ["cuda"], "gloo"),
    ],
)
def test_epoch_backend_follows_every_members_device(configured, learner, members, want):
    assert epoch_backend(configured, learner, members) == want


def _parked_admit(server, member: str) -> tuple[threading.Thread, list]:
    """An ADMIT of 8 by `member`'s service (`<member>.a`), long-polled on its own client until
    the server parks it. Returns the thread asking and the list its reply lands in."""
    asked: list = []

    def ask() -> None:
        own = ControlClient(server.endpoint, timeout_s=5)
        try:
            asked.append(own.admit(f"{member}.a", 8, 4, wait_ms=60_000, member=member))
        finally:
            own.close()

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    wait_until(lambda: len(server._parked) == 1, 10, "the ADMIT parked", interval_s=0.005)
    return thread, asked


def test_a_grant_follows_the_asking_services_own_verified_version(control):
    """Batch 8, max_staleness 0: quota is 8 per version. A service whose own receiver verified
    v1 is admitted on v1 at once, before every member has it (published is still 0); one that
    has not verified it waits for the publish, and a report cannot raise quota past what the
    learner announced."""
    server, client = control
    membership = Membership()
    server.attach_membership(membership)
    client.join("rollout-0", "inc-a", -1)
    client.join("rollout-1", "inc-b", -1)
    assert client.admit("rollout-0.a", 8, 4, member="rollout-0").granted == 8  # v0's quota used up
    membership.next_seq(1)  # the learner announces v1 ...
    thread, asked = _parked_admit(server, "rollout-0")  # ... while rollout-0 long-polls for more
    client.sync_report("rollout-0", "inc-a", epoch=0, version=1, outcome="ok")  # its receiver has v1
    thread.join(timeout=10)
    assert asked and asked[0].granted == 8 and asked[0].weights_version == 1
    # rollout-1 has not verified v1, and an ADMIT naming no member follows the published v0
    assert client.admit("rollout-1.b", 8, 4, member="rollout-1").granted == 0
    assert client.admit("rollout-1.b", 8, 4).granted == 0
    client.sync_report("rollout-1", "inc-b", epoch=0, version=7, outcome="ok")  # never announced
    assert membership.verified("rollout-1") == 1 and membership.verified("rollout-9") == -1
    assert client.admit("rollout-1.b", 8, 4, member="rollout-1").granted == 0  # v1's quota is used
    server.set_published(1)
    assert client.admit("rollout-1.b", 8, 4).granted == 0  # published v1: 16 started of 16


def test_a_member_of_the_epoch_is_granted_on_a_version_once_it_is_announced(control):
    """Batch 8, max_staleness 0. A member of the current epoch is sent every announced version
    and takes it before it generates, so its parked ADMIT is answered when the learner announces
    v1, with weights_version 1, before its receiver reports anything. One still pending (not in
    the epoch the announcement goes to) waits for its own report or the publish."""
    server, client = control
    membership = Membership()
    server.attach_membership(membership)
    client.join("rollout-0", "inc-a", -1)
    _, _, candidates = membership.begin_epoch()
    membership.commit_epoch(candidates, dropped=[])
    client.join("rollout-1", "inc-b", -1)  # after the epoch: pending
    assert client.admit("rollout-0.a", 8, 4, member="rollout-0").granted == 8  # v0's quota used up
    thread, asked = _parked_admit(server, "rollout-0")
    membership.next_seq(1)  # the learner announces v1: no report from anyone
    thread.join(timeout=10)
    assert asked and (asked[0].granted, asked[0].weights_version, asked[0].ahead) == (8, 1, True)
    assert membership.admissible("rollout-0") == 1 and membership.verified("rollout-0") == -1
    assert membership.admissible("rollout-1") == -1  # pending: its own report decides
    membership.next_seq(2)
    assert client.admit("rollout-1.b", 8, 4, member="rollout-1").granted == 0  # follows v0
    client.sync_report("rollout-1", "inc-b", epoch=1, version=2, outcome="ok")
    reply = client.admit("rollout-1.b", 8, 4, member="rollout-1")  # on its own v2: not ahead
    assert (reply.granted, reply.weights_version, reply.ahead) == (8, 2, False)
