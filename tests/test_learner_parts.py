"""Learner building blocks: rank balancing, batch transfer, the prefetching batch source,
checkpoints (RNG, optimizer, export), the LR schedule."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch

from sluice.buffer.client import BufferClient
from sluice.config import LearnerConfig, load_config
from sluice.export import ExportError, export_checkpoint
from sluice.learner.balance import assign_to_ranks, balance
from sluice.learner.checkpoint import load_rng, read_state, resolve_resume, rng_state, save_checkpoint
from sluice.learner.dist import DistContext
from sluice.learner.schedule import lr_factor
from sluice.learner.source import BatchSource
from sluice.learner.trainer import Trainer
from sluice.learner.transfer import pack, unpack
from sluice.modeling.policy import materialize_policy_dir
from sluice.trajectory import Trajectory


def traj(i: int, group: str, n: int, version: int = 0) -> Trajectory:
    return Trajectory(
        traj_id=f"t{i}",
        group_id=group,
        version=version,
        group_size=1,
        reward=float(i),
        arrays={
            "prompt_ids": np.arange(3, dtype=np.int32),
            "completion_ids": np.arange(n, dtype=np.int32),
            "behaviour_logprobs": np.full(n, -0.5, np.float32),
        },
        info={"k": i},
    )


def test_balance_is_longest_processing_time_first():
    assert balance([5, 4, 3, 3, 3], 2) == [[0, 3], [1, 2, 4]]  # loads 8 and 10 (optimum 9)
    assert balance([], 3) == [[], [], []]
    with pytest.raises(ValueError):
        balance([1], 0)


def test_ranks_get_whole_groups_balanced_by_tokens():
    costs = [10, 10, 1, 1, 1, 1, 6, 6]
    group_ids = ["a", "a", "b", "b", "b", "b", "c", "c"]
    shares = assign_to_ranks(costs, group_ids, 2)
    assert sorted(i for s in shares for i in s) == list(range(8))
    for s in shares:  # a group never straddles two ranks
        assert len({group_ids[i] for i in s}) == len(
            {
                group_ids[i]
                for i in s
                if group_ids.count(group_ids[i]) == sum(group_ids[j] == group_ids[i] for j in s)
            }
        )
    loads = sorted(sum(costs[i] for i in s) for s in shares)
    assert loads == [16, 20]  # {c, b} vs {a}
    assert assign_to_ranks([3, 3, 3, 3], None, 2) == [[0, 2], [1, 3]]  # no groups: one by one


def test_transfer_round_trip_is_exact():
    trajs = [traj(i, f"g{i // 2}", n) for i, n in enumerate([3, 0, 7])]
    back = unpack(pack(trajs))
    assert [t.traj_id for t in back] == ["t0", "t1", "t2"]
    for a, b in zip(trajs, back):
        assert a.group_id == b.group_id and a.reward == b.reward and a.info == b.info
        for k in a.arrays:
            assert a.arrays[k].dtype == b.arrays[k].dtype and np.array_equal(a.arrays[k], b.arrays[k])
    assert unpack(pack([])) == [] and unpack(b"") == []
    with pytest.raises(ValueError, match="trailing"):
        unpack(pack(trajs) + b"x")


@pytest.mark.parametrize("prefetch", [True, False])
def test_batch_source_leases_whole_groups_under_the_bound(shard_factory, prefetch):
    shard = shard_factory()
    producer = BufferClient([shard.endpoint])
    stop = threading.Event()
    lc = LearnerConfig(batch_size=4, max_staleness=1, get_wait_ms=50, prefetch=prefetch)
    source = BatchSource([shard.endpoint], "default", lc, stop, lease_timeout_s=60)
    try:
        old = [traj(i, f"old{i}", 2, version=0) for i in range(2)]
        fresh = [traj(10 + i, f"new{i}", 2, version=2) for i in range(5)]
        producer.put(old + fresh)
        source.request(3)  # consumed at version 3: min_version 2 drops version 0
        batch = source.take()
        assert batch.min_version == 2 and [t.traj_id for t in batch.leased.trajs] == [
            "t10",
            "t11",
            "t12",
            "t13",
        ]
        assert batch.leased.dropped_stale == 2
        assert batch.gets == 1  # the whole batch was waiting in the shard
        source.request(4)  # t14 (version 2) is too old now: the batch waits for data
        late = [traj(20 + i, f"late{i}", 2, 4) for i in range(4)]
        late_put = threading.Timer(0.3 if prefetch else 0.0, lambda: producer.put(late))
        late_put.start()
        if not prefetch:
            late_put.join()  # the data is there before the take
        batch = source.take()
        late_put.join()  # its PUT's reply too: one client's sockets serve one thread at a time
        assert [t.traj_id for t in batch.leased.trajs] == ["t20", "t21", "t22", "t23"]
        # (the shard counts the drop; a GET parked on an empty queue does not report it back)
        assert producer.stats()[0].stats["dropped_stale"] == 3
        source.request(5)  # nothing there: stop must end take() and give partial leases back
        stop.set()
        assert source.take() is None
    finally:
        source.close()
    stats = producer.stats()[0].stats
    assert stats["leased"] == 8  # the two batches taken (the caller ACKs them), nothing more
    producer.close()


def test_batch_source_tops_up_past_a_lost_lineage_and_accounts_for_its_quota(shard_factory):
    """Trajectories newer than the version (made before a crash by weights the resumed learner
    never made) are leased beyond the batch, which still holds `batch_size` it can train; their
    quota is released as each GET brings them, and charged again when a partial batch holding
    them is given back (they will be released again when leased again)."""
    shard = shard_factory()
    producer = BufferClient([shard.endpoint])
    released: list[int] = []
    returned: list[int] = []
    stop = threading.Event()
    lc = LearnerConfig(batch_size=4, max_staleness=1, get_wait_ms=50, prefetch=True)
    source = BatchSource(
        [shard.endpoint],
        "default",
        lc,
        stop,
        lease_timeout_s=60,
        on_dropped=released.append,
        on_returned=returned.append,
    )
    try:
        # version 3 and version 5 alternate in the queue: t1, t3, t5, t7 are a lost lineage's
        producer.put([traj(i, f"g{i}", 2, version=3 if i % 2 == 0 else 5) for i in range(8)])
        source.request(3)
        batch = source.take()
        assert [t.traj_id for t in batch.leased.trajs if t.version <= 3] == ["t0", "t2", "t4", "t6"]
        # GETs for 4 (t0-t3), then for the 2 missing (t4, t5), then for 1 (t6)
        assert batch.lost_lineage == 3 and released == [2, 1] and batch.gets == 3
        assert not returned
        # at version 4, t7 (version 5) and two of version 9 are all of a lost lineage: leased,
        # released, and charged back when the stopping learner gives its partial batch back
        producer.put([traj(10 + i, f"h{i}", 2, version=9) for i in range(2)])
        source.request(4)
        deadline = time.monotonic() + 10
        while sum(released) < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sum(released) == 6
        stop.set()
        assert source.take() is None
    finally:
        source.close()
    assert returned == [3]
    stats = producer.stats()[0].stats
    assert stats["queued"] == 3 and stats["leased"] == 7  # given back; the first batch's, held
    producer.close()


def test_batch_source_gives_back_a_prefetched_batch_at_close(shard_factory):
    shard = shard_factory()
    producer = BufferClient([shard.endpoint])
    lc = LearnerConfig(batch_size=2, get_wait_ms=50)
    source = BatchSource([shard.endpoint], "default", lc, threading.Event(), lease_timeout_s=60)
    producer.put([traj(i, f"g{i}", 1) for i in range(2)])
    source.request(0)
    deadline = 100
    while producer.stats()[0].stats["leased"] != 2 and deadline:  # the thread leased it
        deadline -= 1
        threading.Event().wait(0.05)
    source.close()
    assert producer.stats()[0].stats["leased"] == 0 and producer.stats()[0].stats["queued"] == 2
    producer.close()


def test_batch_source_never_holds_a_partial_batch_near_its_lease_timeout(shard_factory):
    """Data trickles in slower than the lease timeout: the partial batch is given back and
    assembled again, so no lease expires inside it and no trajectory comes back twice."""
    shard = shard_factory(lease_timeout_s=1.0)
    producer = BufferClient([shard.endpoint])
    lc = LearnerConfig(batch_size=4, get_wait_ms=50)
    source = BatchSource([shard.endpoint], "default", lc, threading.Event(), lease_timeout_s=1.0)
    try:
        producer.put([traj(i, f"g{i}", 1) for i in range(2)])
        more = threading.Timer(1.5, lambda: producer.put([traj(i, f"g{i}", 1) for i in range(2, 4)]))
        more.start()
        source.request(0)
        batch = source.take()
        more.join()  # the producer is used below: one client's sockets serve one thread at a time
        assert sorted(t.traj_id for t in batch.leased.trajs) == ["t0", "t1", "t2", "t3"]
        assert source.restarts >= 1 and batch.gets >= 2
        assert producer.stats()[0].stats["redelivered"] >= 2  # NACKed, never expired inside
        assert producer.ack(batch.leased) == 4  # every lease of the batch is still valid
    finally:
        source.close()
        producer.close()


def test_a_batch_that_gets_its_own_trajectories_back_starts_over_without_duplicates(shard_factory):
    """A lease of the batch being assembled ends at the shard without the learner giving it back
    (here it expires: the shard's timeout is shorter than the one the source was told; a
    restarted shard that could not log the lease does the same), and the next GET brings its
    groups back. The batch starts over from that part (the dead lease's NACK answers
    UNKNOWN_LEASE, which is fine) instead of failing the learner."""
    shard = shard_factory(lease_timeout_s=0.5)
    producer = BufferClient([shard.endpoint], timeout_s=5)
    lc = LearnerConfig(batch_size=4, get_wait_ms=2000, prefetch=False)
    source = BatchSource([shard.endpoint], "default", lc, threading.Event(), lease_timeout_s=600)
    try:
        producer.put([traj(i, f"g{i}", 1) for i in range(2)])
        more = threading.Timer(1.5, lambda: producer.put([traj(i, f"g{i}", 1) for i in range(2, 4)]))
        more.start()
        source.request(0)
        batch = source.take()
        more.join()  # before the producer closes: one client's sockets serve one thread at a time
        ids = [t.traj_id for t in batch.leased.trajs]
        assert len(ids) == len(set(ids)) == 4 and source.restarts >= 1
        assert set(ids) <= {"t0", "t1", "t2", "t3"}
    finally:
        source.close()
        producer.close()


def test_lr_schedule():
    lc = LearnerConfig(lr_schedule="linear", warmup_steps=2)
    f = lr_factor(lc, total_updates=12)
    assert [f(0), f(1), f(2), f(7), f(12)] == [0.5, 1.0, 1.0, 0.5, 0.0]
    cos = lr_factor(LearnerConfig(lr_schedule="cosine"), 10)
    assert cos(0) == 1.0 and abs(cos(5) - 0.5) < 1e-12 and abs(cos(10)) < 1e-12


def test_rng_state_round_trip():
    gen = torch.Generator().manual_seed(5)
    state = rng_state(gen)
    expected = (torch.rand(3), np.random.rand(3), random.random(), torch.rand(2, generator=gen))
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    gen.manual_seed(99)
    path = __import__("tempfile").mkdtemp()
    torch.save(state, f"{path}/rng_rank0.pt")
    load_rng(__import__("pathlib").Path(path), 0, gen)
    got = (torch.rand(3), np.random.rand(3), random.random(), torch.rand(2, generator=gen))
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
    assert got[2] == expected[2] and torch.equal(got[3], expected[3])


@pytest.mark.parametrize("kind", ["llm", "mlp"])
def test_checkpoint_restores_model_optimizer_and_state_and_exports(tmp_path, kind):
    overrides = [
        f"run.dir={tmp_path / 'run'}",
        "model.init.hidden_size=16",
        "model.init.intermediate_size=32",
        "model.init.num_layers=1",
        "model.init.head_dim=8",
    ]
    if kind == "mlp":
        overrides += ["rollout.kind=env", "model.kind=mlp", "learner.loss.type=vtrace"]
    cfg = load_config(None, overrides)
    model_dir = materialize_policy_dir(cfg)
    trainer = Trainer(cfg, DistContext(), model_dir)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.1)
    opt = trainer.backend.optimizer
    for p in trainer.model.parameters():  # give the optimizer some state
        p.grad = torch.ones_like(p)
    trainer.backend.step()
    root = tmp_path / "run" / "checkpoints"
    path = save_checkpoint(root, 7, trainer, DistContext(), {"totals": {"samples": 3}}, keep=1)
    save_checkpoint(root, 8, trainer, DistContext(), {"totals": {"samples": 4}}, keep=1)
    assert not path.exists() and resolve_resume("auto", root).name == "step_000008"  # pruned, latest
    state = read_state(resolve_resume("auto", root))
    assert state["version"] == 8 and state["totals"] == {"samples": 4} and state["acked"] is None
    again = Trainer(cfg, DistContext(), model_dir, resume_dir=resolve_resume("auto", root))
    for (name, a), (_, b) in zip(trainer.model.named_parameters(), again.model.named_parameters()):
        assert torch.equal(a, b), name
    s1, s2 = opt.state_dict(), again.backend.optimizer.state_dict()
    assert s1["state"].keys() == s2["state"].keys()
    assert all(torch.equal(s1["state"][k]["exp_avg"], s2["state"][k]["exp_avg"]) for k in s1["state"])
    assert again.backend.scheduler.last_epoch == trainer.backend.scheduler.last_epoch == 1
    out = export_checkpoint(root, tmp_path / "export")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors"} <= names
    assert not names & {"optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_rank0.pt"}
    if kind == "llm":
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(out)
    else:
        from sluice.modeling.mlp import MLPPolicy

        loaded = MLPPolicy.from_pretrained(out)
    for (name, a), (_, b) in zip(trainer.model.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(ExportError, match="not empty"):
        export_checkpoint(root, out)
    with pytest.raises(FileNotFoundError):
        resolve_resume(str(tmp_path), root)


@pytest.mark.parametrize(
    "overrides",
    [
        ["learner.loss.type=grpo", "learner.llm.aggregation=sequence"],
        ["learner.loss.type=ppo"],
        ["learner.loss.type=decoupled_ppo", "learner.llm.kl_coef=0.1"],
        ["workflow=gspo"],
        ["workflow=rloo"],
        ["workflow=reinforce_pp"],
        ["workflow=dr_grpo"],
    ],
)
def test_token_objective_micro_batches_sum_to_the_whole_loss(tmp_path, overrides):
    from sluice.config.workflow_check import effective_workflow
    from sluice.learner.losses.aggregate import Denominator
    from sluice.learner.objectives.token import TokenObjective
    from sluice.modeling import load_policy
    from sluice.modeling.sampling import SamplingTransform

    cfg = load_config(
        None,
        [
            f"run.dir={tmp_path}",
            "model.init.hidden_size=16",
            "model.init.intermediate_size=32",
            "model.init.num_layers=1",
            "model.init.head_dim=8",
            *overrides,
        ],
    )
    model_dir = materialize_policy_dir(cfg)
    model, tok = load_policy(model_dir)
    with torch.no_grad():
        for p in model.parameters():  # make pi differ from the reference (the saved initial weights)
            p.add_(0.05 * torch.randn_like(p))
    stages = effective_workflow(cfg).learner
    obj = TokenObjective(
        stages, tok.pad_token_id, tok.bos_token_id, SamplingTransform(), torch.device("cpu"), model_dir
    )
    trajs = [traj(i, f"g{i // 3}", n) for i, n in enumerate([1, 4, 2, 6, 3, 1])]
    for t in trajs:
        t.arrays["completion_ids"] = (t.arrays["completion_ids"] % 10 + 3).astype(np.int32)
    piece = obj.prepare(model, trajs, DistContext())
    tokens, seqs = obj.counts(piece)
    assert (tokens, seqs) == (17, 6)
    denom = Denominator(tokens, seqs)
    whole, stats = obj.loss(model, piece, denom)
    assert whole.requires_grad and torch.isfinite(whole)
    parts = obj.micro(piece, 4)
    assert sum(obj.counts(p)[0] for p in parts) == 17
    assert torch.allclose(sum(obj.loss(model, p, denom)[0] for p in parts), whole, atol=1e-6)
    if any(s.stage == "kl_penalty" for s in stages):
        assert stats["kl_ref"] > 0
