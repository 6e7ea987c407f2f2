"""Replay mode: sum-tree, ring eviction, staleness, priorities, importance weights, over the wire."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.groups import make_group
from helpers.wire import raw_request

from sluice.buffer.client import BufferClient, BufferError, SampleRef, shard_of
from sluice.buffer.stores.replay import ReplayStore, importance_weights
from sluice.buffer.sumtree import SumTree
from sluice.config.buffer import ReplayConfig
from sluice.trajectory import Trajectory, to_wire_batch
from sluice.wire import codec

TRANSPORTS = ["zmq", "shm"]  # every shard test runs over both (tests/conftest.py)

# chi-square critical values at p = 0.001 (df -> value); a correct sampler fails 1 run in 1000,
# and the seeds are fixed, so the outcome is deterministic.
CHI2_999 = {3: 16.27, 4: 18.47, 5: 20.52, 7: 24.32}


def group(gid: str, version: int = 0, size: int = 1, nbytes: int = 16) -> list[Trajectory]:
    return make_group(gid, size, version, nbytes)


def put(store: ReplayStore, trajs: list[Trajectory]) -> tuple[int, int]:
    metas, payload = to_wire_batch(trajs)
    return store.put(metas, codec.split_payload(metas, payload))


def chi_square(observed: np.ndarray, expected_p: np.ndarray) -> float:
    expected = expected_p * observed.sum()
    return float(((observed - expected) ** 2 / expected).sum())


# -- sum-tree -------------------------------------------------------------------------------


def test_sumtree_prefix_search_hand_computed():
    tree = SumTree(5)  # 8 leaves, 3 unused
    tree.update(np.arange(5), np.array([1.0, 2.0, 3.0, 4.0, 0.0]))
    assert tree.total == 10.0
    # intervals: slot0 [0,1) slot1 [1,3) slot2 [3,6) slot3 [6,10)
    got = tree.find(np.array([0.0, 0.99, 1.0, 2.99, 3.0, 5.99, 6.0, 9.99]))
    assert got.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    tree.update(np.array([1, 4]), np.array([0.0, 5.0]))
    assert tree.total == 13.0
    # slot0 [0,1) slot2 [1,4) slot3 [4,8) slot4 [8,13)
    assert tree.find(np.array([0.5, 1.0, 4.0, 8.0, 12.9])).tolist() == [0, 2, 3, 4, 4]
    with pytest.raises(ValueError):
        tree.update(np.array([0]), np.array([-1.0]))
    with pytest.raises(IndexError):
        tree.update(np.array([5]), np.array([1.0]))


def test_sumtree_sums_stay_exact_after_many_updates():
    rng = np.random.default_rng(0)
    tree = SumTree(1000)
    values = np.zeros(1000)
    for _ in range(200):
        slots = rng.choice(1000, size=50, replace=False)
        v = rng.random(50) * 10
        values[slots] = v
        tree.update(slots, v)
    assert tree.total == pytest.approx(values.sum(), rel=1e-12)
    assert np.array_equal(tree.leaves, values)


def test_sumtree_never_draws_an_empty_slot():
    tree = SumTree(64)
    tree.update(np.array([3, 40]), np.array([1e-9, 1.0]))
    draws = tree.sample(10000, np.random.default_rng(1))
    assert set(draws.tolist()) <= {3, 40}


def test_importance_weights_hand_computed():
    # PER: w = (N * P)^-beta / max w. N=3, P=(.5,.25,.25), beta=1 -> (1/1.5, 1/.75, 1/.75) / (1/.75)
    w = importance_weights(np.array([0.5, 0.25, 0.25]), count=3, beta=1.0)
    assert w == pytest.approx([0.5, 1.0, 1.0])
    assert importance_weights(np.array([0.5, 0.25]), count=3, beta=0.0) == pytest.approx([1.0, 1.0])


# -- store ----------------------------------------------------------------------------------


def test_ring_evicts_oldest_groups_first():
    s = ReplayStore(capacity=6)
    for g in "abc":
        put(s, group(g, size=2))
    assert s.held == 6
    put(s, group("d", size=2))  # evicts a
    assert [g.group_id for g in s.live_groups()] == ["b", "c", "d"]
    put(s, group("e", size=4))  # evicts b and c
    assert [g.group_id for g in s.live_groups()] == ["d", "e"]
    assert s.counters.evicted_trajs == 6 and s.held == 6
    assert s.version_counts() == {"0": 6}


def test_replay_answers_the_lease_hooks_with_nothing():
    s = ReplayStore(capacity=6)
    put(s, group("a", size=2))
    s.restore_settled({"lease": 2})  # (a log written in fifo mode)
    assert s.next_deadline() is None and s.expire(now=1e9) == [] and s.settled_snapshot() == {}
    assert s.unevictable_bytes == 0 < s.held_bytes  # a PUT evicts: nothing held refuses one


def test_ring_evicts_by_bytes_too():
    s = ReplayStore(capacity=100, capacity_bytes=100)
    put(s, group("a", nbytes=40))
    put(s, group("b", nbytes=40))
    put(s, group("c", nbytes=40))
    assert [g.group_id for g in s.live_groups()] == ["b", "c"]


def test_slots_are_reused_only_after_their_group_left():
    # Dropping stale groups leaves holes; a new group must never overwrite a live slot.
    s = ReplayStore(capacity=4)
    for i, v in enumerate([0, 5, 5, 5]):
        put(s, group(f"g{i}", version=v))
    s.sample(0, "default", min_version=1, beta=0.4, rng=np.random.default_rng(0))  # drops g0
    for i in range(4, 9):
        put(s, group(f"g{i}", version=5))
    live = s.live_groups()
    assert [g.group_id for g in live] == ["g5", "g6", "g7", "g8"]
    assert sorted(int(x) for x in s.slot_seq) == [g.seq for g in live]


def test_stale_groups_are_dropped_before_drawing():
    s = ReplayStore(capacity=100)
    for v in range(5):
        put(s, group(f"v{v}", version=v, size=2))
    sample = s.sample(200, "default", min_version=3, beta=0.4, rng=np.random.default_rng(0))
    assert {d.group.version for d in sample.draws} == {3, 4}
    assert sample.dropped_stale == 6 and sample.count == 2
    assert s.counters.dropped_stale == 6 and sorted(s.take_dropped()) == [0, 1, 2]


def test_priority_updates_new_group_priority_and_unknown_keys():
    s = ReplayStore(capacity=2, replay=ReplayConfig(sampling="prioritized", alpha=1.0, eps=1e-9))
    put(s, group("a"))
    put(s, group("b"))
    assert s.update_priorities([0, 1], [3.0, 1.0]) == (2, 0)
    put(s, group("c"))  # evicts a; gets the largest priority seen so far (3)
    assert s.priorities() == {1: 1.0, 2: 3.0}
    assert s.update_priorities([0, 2], [5.0, 2.0]) == (1, 1)  # key 0 (a) is gone
    with pytest.raises(ValueError, match="priorities\\[0\\]"):
        s.update_priorities([1], [float("nan")])
    with pytest.raises(ValueError, match="priorities\\[0\\]"):
        s.update_priorities([1], [-1.0])
    with pytest.raises(ValueError, match="keys has 2"):
        s.update_priorities([1, 2], [1.0])


def test_policies_have_separate_streams():
    s = ReplayStore(capacity=10)
    put(s, group("a"))
    b = group("b")
    b[0].policy_id = "other"
    put(s, b)
    rng = np.random.default_rng(0)
    assert {d.group.group_id for d in s.sample(50, "default", 0, 0.4, rng).draws} == {"a"}
    assert {d.group.group_id for d in s.sample(50, "other", 0, 0.4, rng).draws} == {"b"}
    assert s.sample(5, "nobody", 0, 0.4, rng).draws == []


# -- over the wire --------------------------------------------------------------------------


def _replay_shard(shard_factory, **replay):
    return shard_factory(mode="replay", replay=ReplayConfig(**replay))


def test_prioritized_sampling_frequencies_match_priorities(shard_factory):
    shard = _replay_shard(shard_factory, sampling="prioritized", alpha=1.0, eps=1e-9)
    priorities = np.array([1.0, 2.0, 3.0, 4.0, 10.0])
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        for i in range(len(priorities)):
            client.put(group(f"g{i}"))
        # a group's key is its shard-local seq: 0..4 in PUT order
        refs = [SampleRef(0, k) for k in range(len(priorities))]
        assert client.update_priorities(refs, priorities).updated == len(priorities)
        counts = np.zeros(len(priorities))
        for seed in range(4):
            batch = client.sample(5000, seed=seed, beta=0.5)
            ids = np.array([int(t.group_id[1:]) for t in batch.trajs])
            counts += np.bincount(ids, minlength=len(priorities))
            # weights: (N * P)^-beta / max, with P the priority share
            p = priorities[ids] / priorities.sum()
            assert batch.probs == pytest.approx(p, rel=1e-9)
            expected_w = (len(priorities) * p) ** -0.5
            assert batch.weights == pytest.approx(expected_w / expected_w.max(), rel=1e-5)
    expected = priorities / priorities.sum()
    assert chi_square(counts, expected) < CHI2_999[4], (counts, expected * counts.sum())


def test_uniform_sampling_ignores_priorities(shard_factory):
    shard = _replay_shard(shard_factory, sampling="uniform")
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        for i in range(4):
            client.put(group(f"g{i}"))
        refs = [SampleRef(0, k) for k in range(4)]
        client.update_priorities(refs, [100.0, 1.0, 1.0, 1.0])
        batch = client.sample(8000, seed=3)
        counts = np.bincount([int(t.group_id[1:]) for t in batch.trajs], minlength=4)
        assert np.all(batch.weights == 1.0)
    assert chi_square(counts, np.full(4, 0.25)) < CHI2_999[3], counts


def test_sampling_across_shards_is_one_distribution(shard_factory):
    """Two prioritized shards sampled together draw like one buffer, with global weights."""
    shards = [_replay_shard(shard_factory, sampling="prioritized", alpha=1.0, eps=1e-9) for _ in range(2)]
    with BufferClient([s.endpoint for s in shards], timeout_s=10, seed=0) as client:
        gids = [f"g{i}" for i in range(6)]
        for g in gids:
            client.put(group(g))
        homes = [shard_of(g, 2) for g in gids]
        assert set(homes) == {0, 1}, "test needs groups on both shards"
        priority = {g: float(i + 1) for i, g in enumerate(gids)}
        # find each group's key via a large uniform draw, then set priorities
        refs = {}
        batch = client.sample(600, beta=0.0)
        for t, ref in zip(batch.trajs, batch.refs):
            refs[t.group_id] = ref
        assert set(refs) == set(gids)
        client.update_priorities([refs[g] for g in gids], [priority[g] for g in gids])
        counts = {g: 0 for g in gids}
        for _ in range(10):
            batch = client.sample(1000, beta=1.0)
            for t in batch.trajs:
                counts[t.group_id] += 1
        p = np.array([priority[g] for g in gids]) / sum(priority.values())
        by_group = {t.group_id: (prob, w) for t, prob, w in zip(batch.trajs, batch.probs, batch.weights)}
        for g, (prob, _) in by_group.items():
            assert prob == pytest.approx(priority[g] / sum(priority.values()), rel=1e-9)
        w_max = max((6 * priority[g] / sum(priority.values())) ** -1.0 for g in by_group)
        for g, (_, w) in by_group.items():
            assert w == pytest.approx((6 * priority[g] / sum(priority.values())) ** -1.0 / w_max, rel=1e-5)
    observed = np.array([counts[g] for g in gids], dtype=float)
    assert chi_square(observed, p) < CHI2_999[5], observed


def test_sample_drops_stale_and_wait_returns_empty(shard_factory):
    shard = _replay_shard(shard_factory)
    with BufferClient([shard.endpoint], timeout_s=10) as client:
        assert client.sample(4, wait_ms=50).trajs == []
        client.put(group("old", version=1, size=2))
        client.put(group("new", version=5, size=2))
        batch = client.sample(10, min_version=3)
        assert {t.group_id for t in batch.trajs} == {"new"} and batch.dropped_stale == 2
        stats = client.stats()[0]
        assert stats.stats["dropped_stale"] == 2 and stats.versions == {"5": 2}


def test_ops_of_the_other_mode_are_refused(shard_factory, zmq_ctx):
    replay = _replay_shard(shard_factory)
    fifo = shard_factory()
    reply = raw_request(zmq_ctx, replay.endpoint, {"proto": 1, "op": "GET", "id": 1, "max_trajs": 1})
    assert reply["code"] == "WRONG_MODE" and "replay" in reply["message"]
    reply = raw_request(zmq_ctx, fifo.endpoint, {"proto": 1, "op": "SAMPLE", "id": 2, "n": 1})
    assert reply["code"] == "WRONG_MODE" and "fifo" in reply["message"]
    reply = raw_request(
        zmq_ctx, fifo.endpoint, {"proto": 1, "op": "PRIORITY", "id": 3, "keys": [], "priorities": []}
    )
    assert reply["code"] == "WRONG_MODE"
    with BufferClient([replay.endpoint], timeout_s=5) as client, pytest.raises(BufferError) as e:
        client.get(1)
    assert e.value.code == "WRONG_MODE"


@pytest.mark.parametrize(
    "header,code,needle",
    [
        ({"n": -1}, "BAD_HEADER", "n=-1"),
        ({"n": 10**9}, "TOO_LARGE", "n="),
        ({"n": 1, "beta": -0.5}, "BAD_HEADER", "beta"),
        ({"n": 1, "beta": float("nan")}, "BAD_HEADER", "beta"),
    ],
)
def test_bad_sample_requests(shard_factory, zmq_ctx, header, code, needle):
    shard = _replay_shard(shard_factory)
    reply = raw_request(zmq_ctx, shard.endpoint, {"proto": 1, "op": "SAMPLE", "id": 7, **header})
    assert reply["code"] == code and needle in reply["message"] and reply["id"] == 7


@pytest.mark.parametrize(
    "keys,priorities,needle",
    [([0], [-1.0], "priorities[0]"), ([0, 1], [1.0], "keys has 2"), ([0], [float("inf")], "priorities[0]")],
)
def test_bad_priority_requests(shard_factory, zmq_ctx, keys, priorities, needle):
    shard = _replay_shard(shard_factory, sampling="prioritized")
    header = {"proto": 1, "op": "PRIORITY", "id": 8, "keys": keys, "priorities": priorities}
    reply = raw_request(zmq_ctx, shard.endpoint, header)
    assert reply["code"] == "BAD_HEADER" and needle in reply["message"]
