"""Receivers in real processes that crash or hang mid-sync never hang the learner; the group is
rebuilt without them and the next versions reach the rest; a revived receiver joins again."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch
from helpers.wait import wait_until
from helpers.weight_sync_env import ProbeProcess, SyncEnv, model_digest, perturb, small_cfg

from sluice.control.client import ControlClient
from sluice.weight_sync.announcements import HEAD_KEY, ann_key, epoch_key
from sluice.weight_sync.broadcaster import WeightBroadcaster

pytestmark = pytest.mark.slow


class SlowGatherBroadcaster(WeightBroadcaster):
    """Each bucket takes a while to gather (as from a big sharded model), so a receiver killed
    after the first bucket went out is certainly killed in the middle of the publish."""

    def _send(self, version, layout, produce, *args, **kwargs):
        def slow(i, bucket, bounds, wire_sums):
            time.sleep(0.05)  # a slow gather: the scenario, not a wait
            return produce(i, bucket, bounds, wire_sums)

        return super()._send(version, layout, slow, *args, **kwargs)


# `env_factory` (SyncEnv instances closed at teardown) is a fixture of tests/conftest.py.


def big_model() -> torch.nn.Module:
    """~48 MiB of fp32: a publish to three receivers takes long enough to be hit mid-way."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)])


def publish_in_thread(env: SyncEnv, version: int, model: torch.nn.Module) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        t0 = time.monotonic()
        out["stats"] = env.broadcaster.publish(version, model)
        out["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def wait_first_bucket(env: SyncEnv, seq: int, timeout_s: float = 20.0) -> None:
    check = env.broadcaster.store.check
    wait_until(lambda: check([ann_key(seq, "sums")]), timeout_s, "the publish sending", interval_s=0.001)


def test_background_confirmation_reports_every_version_and_survives_a_killed_receiver(env_factory, tmp_path):
    """`confirm: background`: publish returns once sent; `on_confirmed` follows when every
    member verified. A receiver killed after the sends is found by the confirmation (no
    heartbeat), and the next publish forms a new epoch that reaches the survivors."""
    cfg = small_cfg(confirm="background", publish_timeout_s=20, ready_timeout_s=3, liveness_timeout_s=2)
    env = env_factory(cfg)
    model = big_model()
    probes = [env.probe(f"rollout-{i}", tmp_path) for i in range(3)]
    env.wait_members(3)
    confirmed: list[int] = []
    done = threading.Event()

    def on_confirmed(version: int) -> None:
        confirmed.append(version)
        done.set()

    stats = env.broadcaster.publish(1, model, on_confirmed)
    assert stats.members == 3 and stats.confirm_seconds < 1e-3  # nothing awaited in publish
    assert done.wait(timeout=20) and confirmed == [1]
    for p in probes:
        assert p.wait_version(1)["digest"] == model_digest(model)
    victim = next(p for p in probes if p.service_id == env.broadcaster._members[-1])
    victim.kill(signal.SIGKILL)
    perturb(model)
    # sent to a group with a dead member: the learner's own send fails (then it resends to the
    # survivors at once, and confirms) or only the background confirmation finds out
    second = env.broadcaster.publish(2, model, on_confirmed)
    perturb(model)
    t0 = time.monotonic()
    stats = env.broadcaster.publish(3, model, on_confirmed)  # finds v2 unconfirmed, rebuilds
    assert time.monotonic() - t0 < cfg.publish_timeout_s, "waited out the timeout, not the heartbeat"
    assert stats.members == 2 and stats.delivered
    survivors = [p for p in probes if p is not victim]
    for p in survivors:
        assert p.wait_version(3)["digest"] == model_digest(model)
    done.clear()
    wait_until(lambda: 3 in confirmed, 20, lambda: f"v3 confirmed (confirmed: {confirmed})")
    assert (2 in confirmed) == second.retried  # confirmed only where it was resent and verified


def test_background_send_delivers_the_packed_version_while_the_model_moves_on(env_factory, tmp_path):
    """`send: background`: publish returns once the version is packed (pending stats); the
    members get exactly the weights of that moment although the model changes right after, and
    `on_confirmed` follows. A receiver killed meanwhile is retried around in the thread: the
    next versions reach the survivors and are confirmed."""
    cfg = small_cfg(confirm="background", send="background", publish_timeout_s=20, ready_timeout_s=3,
                    liveness_timeout_s=2)  # fmt: skip
    env = env_factory(cfg)
    model = big_model()
    probes = [env.probe(f"rollout-{i}", tmp_path) for i in range(3)]
    env.wait_members(3)
    confirmed: list[int] = []
    digests = {}
    for version in (1, 2):
        digests[version] = model_digest(model)
        stats = env.broadcaster.publish(version, model, confirmed.append)
        assert stats.pending and stats.version == version
        perturb(model)  # at once: the thread is still sending what was packed
    for p in probes:
        assert p.wait_version(2)["digest"] == digests[2]
    wait_until(lambda: confirmed == [1, 2], 20, lambda: f"v1, v2 confirmed (confirmed: {confirmed})")
    victim = next(p for p in probes if p.service_id == env.broadcaster._members[-1])
    victim.kill(signal.SIGKILL)
    for version in (3, 4):
        digests[version] = model_digest(model)
        env.broadcaster.publish(version, model, confirmed.append)
        perturb(model)
    survivors = [p for p in probes if p is not victim]
    for p in survivors:
        assert p.wait_version(4)["digest"] == digests[4]
    wait_until(lambda: 4 in confirmed, 20, lambda: f"v4 confirmed (confirmed: {confirmed})")
    assert env.broadcaster.publish(5, model).pending
    env.broadcaster._finish_confirm()  # the thread's publish of v5 is over: its stats are final
    assert env.broadcaster.group is not None and env.broadcaster.group.world_size - 1 == 2


def test_background_send_needs_background_confirmation():
    with pytest.raises(ValueError, match="weight_sync.send=background needs weight_sync.confirm"):
        small_cfg(confirm="wait", send="background")


def test_receiver_killed_mid_sync_does_not_hang_the_learner(env_factory, tmp_path):
    # a long ready timeout: the learner must not wait it out for the dead receiver
    cfg = small_cfg(bucket_mb=1.0, publish_timeout_s=20, ready_timeout_s=40, liveness_timeout_s=2)
    env = env_factory(cfg, broadcaster_cls=SlowGatherBroadcaster)
    model = big_model()
    probes = [env.probe(f"rollout-{i}", tmp_path) for i in range(3)]
    env.wait_members(3)
    assert env.broadcaster.publish(1, model).members == 3
    for p in probes:
        assert p.wait_version(1)["digest"] == model_digest(model)
    perturb(model)
    seq = int(env.broadcaster.store.get(HEAD_KEY))  # the next announcement: version 2
    thread, out = publish_in_thread(env, 2, model)
    # the highest rank: in gloo's broadcast tree a leaf fed by another receiver, so the
    # learner's own sends all succeed and only the members' reports tell it what happened
    victim = next(p for p in probes if p.service_id == env.broadcaster._members[-1])
    wait_first_bucket(env, seq)
    victim.kill(signal.SIGKILL)  # a real crash while the buckets are on the wire
    thread.join(timeout=cfg.publish_timeout_s + cfg.ready_timeout_s + 20)
    assert not thread.is_alive(), "the learner hangs on a dead receiver"
    # found by a failure or the heartbeat, not the (long) collective timeout, and the next
    # epoch formed without waiting for the dead receiver's confirmation
    assert out["stats"].retried and out["seconds"] < cfg.publish_timeout_s
    survivors = [p for p in probes if p is not victim]
    for p in survivors:
        assert p.wait_version(2)["digest"] == model_digest(model)  # this version still reached them
    perturb(model)
    stats = env.broadcaster.publish(3, model)  # the next version, over the rebuilt group
    assert stats.members == 2 and stats.delivered
    for p in survivors:
        got = p.wait_version(3)
        assert got["version"] == 3 and got["digest"] == model_digest(model)
    assert set(env.broadcaster.membership.status().members) == {p.service_id for p in survivors}


def test_hung_receiver_is_dropped_after_the_timeout_and_rejoins_when_it_wakes(env_factory, tmp_path):
    # a long ready timeout: the hung member's stopped heartbeat, not the timeout, drops it
    cfg = small_cfg(bucket_mb=1.0, publish_timeout_s=3, ready_timeout_s=40, liveness_timeout_s=2)
    env = env_factory(cfg)
    model = big_model()
    probes = [env.probe(f"rollout-{i}", tmp_path) for i in range(3)]
    env.wait_members(3)
    env.broadcaster.publish(1, model)
    for p in probes:
        p.wait_version(1)
    probes[2].kill(signal.SIGSTOP)  # alive but not taking part (swapped out, debugger, ...)
    perturb(model)
    t0 = time.monotonic()
    stats = env.broadcaster.publish(2, model)
    elapsed = time.monotonic() - t0
    assert elapsed < cfg.ready_timeout_s, elapsed
    assert stats.retried and stats.delivered and stats.members == 2
    for p in probes[:2]:
        assert p.wait_version(2)["digest"] == model_digest(model)
    probes[2].kill(signal.SIGCONT)  # it wakes up, sees it was left out, pulls and joins again
    got = probes[2].wait_version(2)
    assert got["digest"] == model_digest(model) and got["pulls"] >= 1
    env.wait_members(3)
    perturb(model)
    assert env.broadcaster.publish(3, model).members == 3
    for p in probes:
        assert p.wait_version(3)["digest"] == model_digest(model)


def test_receiver_killed_between_publishes_is_not_waited_for_when_the_next_epoch_forms(env_factory, tmp_path):
    """The learner's send to a dead direct peer fails at once ("connection closed"), naming no
    member; the next epoch's candidates include the dead one, whose heartbeat in the failed
    epoch has stopped: that, not `ready_timeout_s`, ends the wait for its confirmation."""
    cfg = small_cfg(bucket_mb=1.0, publish_timeout_s=20, ready_timeout_s=40, liveness_timeout_s=2)
    env = env_factory(cfg)
    model = big_model()
    probes = [env.probe(f"rollout-{i}", tmp_path) for i in range(3)]
    env.wait_members(3)
    assert env.broadcaster.publish(1, model).members == 3
    victim = next(p for p in probes if p.service_id == env.broadcaster._members[0])  # the learner's peer
    victim.kill(signal.SIGKILL)
    victim.proc.wait(timeout=10)
    perturb(model)
    t0 = time.monotonic()
    stats = env.broadcaster.publish(2, model)
    assert time.monotonic() - t0 < cfg.ready_timeout_s, "waited out the dead member's confirmation"
    assert stats.retried and stats.delivered and stats.members == 2
    for p in probes:
        if p is not victim:
            assert p.wait_version(2)["digest"] == model_digest(model)
    assert victim.service_id not in env.broadcaster.membership.status().members


def publish_past_the_lost_member(env: SyncEnv, model: torch.nn.Module, survivors) -> None:
    """Publish version 1 while a member is lost between confirming and connecting: it reaches
    the two `survivors` well within the connect timeout."""
    t0 = time.monotonic()
    stats = env.broadcaster.publish(1, model)
    elapsed = time.monotonic() - t0
    assert elapsed < env.cfg.ready_timeout_s / 4, f"waited {elapsed:.1f}s for the lost member's connect"
    assert stats.delivered and stats.members == 2
    for p in survivors:
        assert p.wait_version(1)["digest"] == model_digest(model)


class StopsAMemberAfterItConfirmed(WeightBroadcaster):
    """SIGSTOPs `victim` right after it confirmed an epoch (so the epoch commits it): alive, so
    no launcher LEAVEs for it, and silent, so the group's connect alone would wait for it until
    its timeout."""

    victim: ProbeProcess | None = None

    def _await_ready(self, epoch, candidates):
        ready = super()._await_ready(epoch, candidates)
        victim, self.victim = self.victim, None
        if victim is not None and victim.service_id in ready:
            victim.kill(signal.SIGSTOP)
        return ready


def test_a_member_stopped_while_the_group_connects_is_left_out_after_its_heartbeat_stops(
    env_factory, tmp_path
):
    """A member SIGSTOPped between confirming and connecting (a debugger, a swapped-out pod)
    no longer holds the connect for `ready_timeout_s`: its heartbeat stops, the learner gives
    the connect up after `liveness_timeout_s`, and the same publish forms the next epoch
    without it; woken, it joins again."""
    cfg = small_cfg(bucket_mb=1.0, publish_timeout_s=20, ready_timeout_s=40, liveness_timeout_s=2)
    env = env_factory(cfg, broadcaster_cls=StopsAMemberAfterItConfirmed)
    model = big_model()
    probes = [env.probe(f"rollout-{i}", tmp_path) for i in range(3)]
    env.wait_members(3)
    env.broadcaster.victim = probes[1]
    publish_past_the_lost_member(env, model, survivors=(probes[0], probes[2]))
    probes[1].kill(signal.SIGCONT)
    assert probes[1].wait_version(1)["digest"] == model_digest(model)
    env.wait_members(3)
    perturb(model)
    assert env.broadcaster.publish(2, model).members == 3


class KillsAMemberAfterItConfirmed(WeightBroadcaster):
    """Kills `victim` right after it confirmed an epoch (so the epoch commits it), and reports it
    dead the way a launcher does (LEAVE by pid) once the group is connecting: a member that died
    between confirming and connecting, which the group's connect alone waits for until its
    timeout."""

    victim: ProbeProcess | None = None
    launcher_control = ""  # where the "launcher" sends its LEAVE

    def _await_ready(self, epoch, candidates):
        ready = super()._await_ready(epoch, candidates)
        victim, self.victim = self.victim, None
        if victim is not None and victim.service_id in ready:
            victim.kill(signal.SIGKILL)
            victim.proc.wait(timeout=10)
            threading.Thread(target=self._leave_once_connecting, args=(epoch, victim), daemon=True).start()
        return ready

    def _leave_once_connecting(self, epoch: int, victim: ProbeProcess) -> None:
        store = self.store
        assert store is not None
        commit = epoch_key(epoch, "commit")
        wait_until(lambda: store.check([commit]), 10, "the epoch committed", interval_s=0.001)
        client = ControlClient(self.launcher_control, timeout_s=5)
        try:
            assert client.leave(victim.service_id, pid=victim.proc.pid).removed
        finally:
            client.close()


def test_a_member_that_dies_while_the_group_connects_is_not_waited_for(env_factory, tmp_path):
    """The kill lands between a member's confirmation and its connect (as a kill -9 of a rollout
    while the learner forms the epoch that adds another): the launcher's LEAVE for the dead
    process ends the learner's connect at once and the abort key ends the survivors'; the same
    publish forms the next epoch without it and reaches them, well before the connect timeout."""
    cfg = small_cfg(bucket_mb=1.0, publish_timeout_s=20, ready_timeout_s=40, liveness_timeout_s=2)
    env = env_factory(cfg, broadcaster_cls=KillsAMemberAfterItConfirmed)
    model = big_model()
    probes = [env.probe(f"rollout-{i}", tmp_path) for i in range(3)]
    env.wait_members(3)
    env.broadcaster.victim, env.broadcaster.launcher_control = probes[1], env.control_endpoint
    publish_past_the_lost_member(env, model, survivors=(probes[0], probes[2]))
    assert probes[1].service_id not in env.broadcaster.membership.status().members
    perturb(model)
    assert env.broadcaster.publish(2, model).members == 2  # the new epoch's group works on
