"""Weights published by the learner arrive bit-identical in rollout engines, version-tagged;
corrupt or mismatched versions are refused; late joiners pull the current version."""

from __future__ import annotations

import inspect
import time

import pytest
import torch
from helpers.wait import wait_until
from helpers.weight_sync_env import perturb, small_cfg, wait_version

import sluice.weight_sync.broadcaster as broadcaster_module
import sluice.weight_sync.group as group_module
import sluice.weight_sync.pipeline as pipeline_module
import sluice.weight_sync.receiver as receiver_module
from sluice.config.model import ModelConfig, TinyModelInit
from sluice.control.client import ControlClient
from sluice.modeling import load_policy, materialize_model_dir
from sluice.rollout_svc.engines.hf import HFEngine
from sluice.weight_sync.broadcaster import WeightBroadcaster
from sluice.weight_sync.checksums import ChecksumWorker
from sluice.weight_sync.receiver import WeightReceiver

# `env_factory` (SyncEnv instances closed at teardown) is a fixture of tests/conftest.py.


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Embedding(50, 24), torch.nn.Linear(24, 48), torch.nn.LayerNorm(48), torch.nn.Linear(48, 50)
    )


def expected(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(dtype).clone() for n, p in model.named_parameters()}


def assert_identical(got: list[tuple[str, torch.Tensor]], want: dict[str, torch.Tensor]) -> None:
    got_d = dict(got)
    assert got_d.keys() == want.keys()
    for name, tensor in want.items():
        assert got_d[name].dtype == tensor.dtype, name
        assert torch.equal(got_d[name], tensor), name  # bit-identical (no NaNs in the model)


def test_weights_reach_hf_engines_bit_identical(tmp_path, env_factory):
    model_dir = materialize_model_dir(ModelConfig(init=TinyModelInit(seed=1)), tmp_path)
    learner_model, _ = load_policy(model_dir)
    env = env_factory()
    env.broadcaster.publish(0, learner_model)
    receivers = [env.receiver(f"rollout-{i}") for i in range(2)]
    engines = [HFEngine(model_dir, seed=i) for i in range(2)]
    env.wait_members(2)
    for version in (1, 2):
        perturb(learner_model)
        stats = env.broadcaster.publish(version, learner_model)
        assert stats.members == 2 and stats.delivered
        want = {k: v.detach().clone() for k, v in learner_model.named_parameters()}
        for engine, receiver in zip(engines, receivers):
            got = wait_version(receiver, version)  # (skips the v0 pulled on joining)
            assert got.version == version
            engine.load_weights(got.tensors, got.version)
            state = engine.state_dict()
            assert state.keys() == want.keys()
            for name, tensor in want.items():
                assert torch.equal(state[name], tensor), name
            assert engine.version == version
    assert all(r.error is None and r.refused_versions == 0 and r.pulls == 1 for r in receivers)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(  # a bucket per tensor .. one bucket; whole buckets .. tensors in pieces
    ("bucket_mb", "piece_mb"), [(0.002, 64.0), (0.004, 0.001), (64.0, 0.003), (64.0, 64.0)]
)
@pytest.mark.parametrize("checksum", ["auto", "wsum32"])  # auto: xxh3 on gloo; wsum32: nccl's
def test_bit_identical_for_dtypes_and_bucket_sizes(env_factory, dtype, bucket_mb, piece_mb, checksum):
    model = tiny_model()
    env = env_factory(
        small_cfg(bucket_mb=bucket_mb, piece_mb=piece_mb, dtype=dtype, pipeline_depth=2, checksum=checksum)
    )
    receiver = env.receiver("rollout-0")
    env.wait_members(1)
    wire = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    for version in (1, 2, 3):
        perturb(model)
        stats = env.broadcaster.publish(version, model)  # fp32 master weights, cast on the fly
        assert stats.members == 1
        assert 0 < stats.send_seconds and 0 < stats.confirm_seconds
        assert stats.send_seconds + stats.confirm_seconds <= stats.seconds
        got = wait_version(receiver, version)
        assert got.version == version
        assert_identical(got.tensors, expected(model, wire))
    n_buckets = len(env.broadcaster._layout)
    assert n_buckets == 1 if bucket_mb == 64.0 else n_buckets >= 2


class SlowChecksums(ChecksumWorker):
    """The learner's checksums reach the store well after the data (a loaded learner)."""

    def _hash(self, *args) -> None:
        time.sleep(0.2)  # a slow checksum: what the test is about
        super()._hash(*args)


def test_receivers_wait_for_checksums_that_follow_the_data(env_factory, monkeypatch):
    monkeypatch.setattr(pipeline_module, "ChecksumWorker", SlowChecksums)
    model = tiny_model()
    env = env_factory(small_cfg(bucket_mb=0.004, piece_mb=0.002))
    receiver = env.receiver("rollout-0")
    env.wait_members(1)
    perturb(model)
    stats = env.broadcaster.publish(1, model)
    assert stats.delivered and stats.members == 1
    assert_identical(wait_version(receiver, 1).tensors, expected(model, torch.float32))
    assert receiver.refused_versions == 0 and receiver.failures == 0


class CorruptingBroadcaster(WeightBroadcaster):
    """Flips one bit of bucket 1 on the wire after its checksum was taken, for chosen versions
    (what a bad link or a buggy copy would do). The snapshot stays intact."""

    corrupt_versions: set[int] = set()

    def _send(self, version, layout, produce, *args, **kwargs):
        if version not in self.corrupt_versions:
            return super()._send(version, layout, produce, *args, **kwargs)

        def corrupted(i, bucket, bounds, wire_sums):
            for j, (wire, host, wsum) in enumerate(produce(i, bucket, bounds, wire_sums)):
                if i == 1 and j == 0:
                    wire = wire.clone()
                    wire.view(torch.uint8)[3] ^= 0x10
                yield wire, host, wsum

        return super()._send(version, layout, corrupted, *args, **kwargs)


@pytest.mark.parametrize("checksum", ["xxh3", "wsum32"])
def test_corrupted_bucket_is_refused_and_old_weights_kept(env_factory, checksum):
    model = tiny_model()
    # delta=True: the receiver keeps the held version (as a delta base), so it can be checked
    env = env_factory(
        small_cfg(bucket_mb=0.002, delta=True, checksum=checksum), broadcaster_cls=CorruptingBroadcaster
    )
    env.broadcaster.corrupt_versions = {2}
    receiver = env.receiver("rollout-0")
    env.wait_members(1)
    perturb(model)
    env.broadcaster.publish(1, model)
    assert wait_version(receiver, 1).version == 1
    v1_expected = expected(model, torch.float32)
    perturb(model)
    env.broadcaster.publish(2, model)  # corrupted in transit
    wait_until(lambda: receiver.refused_versions == 1, 20, "the version refused")
    assert receiver.take_latest() is None and receiver.version == 1  # nothing new to load
    assert_identical(receiver.held().tensors, v1_expected)  # old weights kept
    perturb(model)
    env.broadcaster.publish(3, model)  # the learner saw the refusal report meanwhile
    v3 = wait_version(receiver, 3)
    assert v3.version == 3
    assert_identical(v3.tensors, expected(model, torch.float32))
    status = env.broadcaster.membership.status()
    assert status.members["rollout-0"].refused == 1
    assert "checksum mismatch" in status.members["rollout-0"].last_error
    assert status.counters["receiver_refused"] == 1
    # ... and it is visible on the control plane
    client = ControlClient(env.control_endpoint, timeout_s=5)
    try:
        ws = client.status().weight_sync
        assert ws is not None and ws.members["rollout-0"].refused == 1 and ws.published_version == 3
    finally:
        client.close()


def test_mismatched_layout_is_refused(env_factory):
    model = tiny_model()
    env = env_factory()
    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    shapes["1.weight"] = [48, 25]  # the engine's model differs from the learner's
    receiver = env.receiver("rollout-0", expected=shapes)
    env.wait_members(1)
    env.broadcaster.publish(1, model)
    wait_until(lambda: receiver.refused_versions == 1, 20, "the version refused")
    assert receiver.take_latest() is None and receiver.version == -1
    assert env.broadcaster.membership.status().members["rollout-0"].refused == 1


def test_late_joiner_pulls_current_version_then_joins_the_group(env_factory):
    model = tiny_model()
    env = env_factory(small_cfg(transfer={"chunk_mb": 0.001, "window": 3}))
    early = env.receiver("rollout-0")
    env.wait_members(1)
    for version in (1, 2, 3):
        perturb(model)
        env.broadcaster.publish(version, model)
    assert wait_version(early, 3).version == 3
    late = env.receiver("rollout-1")
    got = wait_version(late, 3)  # through the ZeroMQ chunked transfer
    assert got.version == 3 and late.pulls == 1
    assert_identical(got.tensors, expected(model, torch.float32))
    env.wait_members(2)
    perturb(model)
    stats = env.broadcaster.publish(4, model)  # a new epoch with both
    assert stats.members == 2 and stats.epoch == 2
    for r in (early, late):
        got = wait_version(r, 4)
        assert got.version == 4
        assert_identical(got.tensors, expected(model, torch.float32))
    assert late.pulls == 1 and late.epoch == 2


def test_a_receiver_that_joins_while_a_version_is_in_flight_pulls_it_once_published(env_factory):
    """The JOIN lands after v1 was announced to the old epoch and before its send settled: the
    next announcement is v2's, so without a catch-up the joiner would wait on v0 until then (at
    max_staleness 0 that was a deadlock: its grant held for weights that never came)."""
    import threading

    model = tiny_model()
    env = env_factory(small_cfg(send="background", confirm="background"))
    early = env.receiver("rollout-0")
    env.wait_members(1)
    env.broadcaster.publish(0, model)
    assert wait_version(early, 0).version == 0
    wait_until(lambda: env.broadcaster.membership.published_version == 0, 10, "v0 settled")
    settle, release = env.broadcaster._settle, threading.Event()
    env.broadcaster._settle = lambda *a: (release.wait(30), settle(*a))[1]  # v1 stays in flight
    perturb(model)
    env.broadcaster.publish(1, model)
    assert wait_version(early, 1).version == 1  # sent and received; the learner has not settled
    late = env.receiver("rollout-1")
    env.wait_members(2)
    assert late.version == 0  # the published snapshot: v1's is kept only once it settles
    release.set()
    got = wait_version(late, 1, timeout_s=10)
    assert_identical(got.tensors, expected(model, torch.float32))


def test_leave_rebuilds_group_without_the_service(env_factory):
    model = tiny_model()
    env = env_factory()
    a, b = env.receiver("rollout-0"), env.receiver("rollout-1")
    env.wait_members(2)
    assert env.broadcaster.publish(1, model).members == 2
    b.stop()  # LEAVEs
    assert env.broadcaster.membership.registered() == 1
    perturb(model)
    stats = env.broadcaster.publish(2, model)
    assert stats.members == 1 and not stats.retried
    got = wait_version(a, 2)
    assert_identical(got.tensors, expected(model, torch.float32))


def test_epochs_connect_on_store_clients_made_ahead(env_factory, monkeypatch):
    """Under CPU load a new TCPStore client's first operations took 5 s now and then (its
    connect, its first wait in a group's connect), which missed the connect timeout in loaded
    test runs: the learner and every receiver make their clients ahead, so forming epochs (two
    joins, a leave) makes none on the way to a connect."""
    made_forming: list[str] = []

    def counting(real):
        def new_client(store):
            names = {frame.function for frame in inspect.stack()}
            if names & {"_try_form_epoch", "_enter_epoch", "make_group"}:
                made_forming.append(
                    ",".join(sorted(names & {"_try_form_epoch", "_enter_epoch"})) or "make_group"
                )
            return real(store)

        return new_client

    for module in (group_module, broadcaster_module, receiver_module):
        monkeypatch.setattr(module, "new_client", counting(group_module.new_client), raising=False)
    model = tiny_model()
    env = env_factory()
    a = env.receiver("rollout-0")
    env.wait_members(1)
    assert env.broadcaster.publish(1, model).members == 1
    b = env.receiver("rollout-1")
    env.wait_members(2)
    assert env.broadcaster.publish(2, model).members == 2
    b.stop()
    assert env.broadcaster.publish(3, model).members == 1
    assert wait_version(a, 3).version == 3 and a.epoch >= 3
    assert made_forming == []


def test_a_receiver_that_joins_after_the_shutdown_announcement_ends_cleanly(env_factory):
    """A rollout service that starts as the run ends (a restart, a late pod) JOINs after the
    learner announced its shutdown: told so in the reply, it ends as the members do (it used to
    wait for announcements past the last one until the learner's store went away, then fail)."""
    model = tiny_model()
    env = env_factory()
    member = env.receiver("rollout-0")
    env.wait_members(1)
    env.broadcaster.publish(1, model)
    assert wait_version(member, 1).version == 1
    env.broadcaster.announce_shutdown()
    env.broadcaster.announce_shutdown()  # once: a second call announces nothing more
    late = env.receiver("rollout-1")
    for r in (member, late):
        assert r.finished.wait(10), f"{r.service_id} did not end"
        assert r.error is None
    assert late.version == 1  # it pulled the published weights before its JOIN
    membership = env.broadcaster.membership
    assert membership.counters["joins_after_shutdown"] == 1 and membership.registered() == 0


def test_a_receiver_stopped_before_the_learners_store_is_up_ends_at_once():
    """A rollout service stopped while its learner is not (or no longer) there, as when the
    launcher is killed during start-up: its receiver does not wait out the store's 60 s connect
    (TCPStore retries in C++, which a stop cannot interrupt) and ends without an error."""
    cfg = small_cfg(timeout_s=60)  # nothing serves its master_port
    receiver = WeightReceiver(cfg, service_id="rollout-0", control_endpoint="tcp://127.0.0.1:1")
    receiver.start()
    time.sleep(0.3)  # the scenario: it is waiting for the store when the stop comes
    started = time.monotonic()
    receiver.stop(timeout_s=30)
    assert not receiver._thread.is_alive() and time.monotonic() - started < 10
    assert receiver.error is None


@pytest.mark.parametrize("checksum", ["auto", "wsum32"])
def test_delta_sync_sends_only_changed_tensors(env_factory, checksum):
    model = tiny_model()
    env = env_factory(small_cfg(delta=True, bucket_mb=0.01, checksum=checksum))
    receiver = env.receiver("rollout-0")
    env.wait_members(1)
    full = env.broadcaster.publish(1, model)  # first publish of an epoch: everything
    assert full.delta_tensors == -1
    assert wait_version(receiver, 1).version == 1
    with torch.no_grad():  # a step that touches only the norm (the rest is frozen)
        model[2].weight.add_(1.0)
        model[2].bias.add_(1.0)
    delta = env.broadcaster.publish(2, model)
    assert delta.delta_tensors == 2 and delta.bytes == 2 * 48 * 4
    got = wait_version(receiver, 2)
    assert got.version == 2
    assert_identical(got.tensors, expected(model, torch.float32))
    unchanged = env.broadcaster.publish(3, model)  # nothing moved: an empty delta
    assert unchanged.delta_tensors == 0 and unchanged.bytes == 0
    got = wait_version(receiver, 3)
    assert got.version == 3
    assert_identical(got.tensors, expected(model, torch.float32))


class HookedBroadcaster(WeightBroadcaster):
    """Runs `before_send` right before a version is announced (after the epoch was formed)."""

    before_send = None

    def _send(self, version, layout, produce, *args, **kwargs):
        if self.before_send is not None:
            hook, self.before_send = self.before_send, None
            hook()
        return super()._send(version, layout, produce, *args, **kwargs)


def test_a_service_that_joined_after_the_epoch_formed_catches_up_by_pulling(env_factory):
    model = tiny_model()
    env = env_factory(broadcaster_cls=HookedBroadcaster)
    early = env.receiver("rollout-0")
    env.wait_members(1)
    env.broadcaster.publish(1, model)
    late = []

    def join_late() -> None:  # the JOIN lands after this publish chose its epoch's members
        late.append(env.receiver("rollout-1"))
        env.wait_members(2)

    env.broadcaster.before_send = join_late
    perturb(model)
    assert env.broadcaster.publish(2, model).members == 1
    got = wait_version(late[0], 2)  # without waiting for the next epoch
    assert got.version == 2 and late[0].pulls == 2 and late[0].epoch == 0
    assert_identical(got.tensors, expected(model, torch.float32))
    assert wait_version(early, 2).version == 2
