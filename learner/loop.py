"""The learner group of one policy: receive a batch under the staleness bound, train, publish,
checkpoint, acknowledge.

Version `v` = learner steps taken = the policy version rollouts tag their samples with. The
step that turns v into v+1 only consumes samples with `v - sample.version <= max_staleness`:
the buffer drops older ones when asked with `min_version = v - max_staleness`, and this loop
checks again (a safety net that counts, and never trains on, a violation). Rank 0 alone talks
to the buffer, holds every lease and splits each batch over the ranks; docs/architecture.md
("Learner groups", "How ranks share a batch") says why.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from sluice.buffer.client import BufferClient
from sluice.buffer.holder import Holder
from sluice.buffer.placement import ShardUnavailable
from sluice.config.policy import checkpoint_root, policy_view, role_suffix
from sluice.config.run import RunConfig
from sluice.control.admission import AdmissionPolicy
from sluice.control.server import ControlServer, samples_by_service
from sluice.launch.heap import freeze_startup_heap, retain_freed_memory
from sluice.launch.threads import ComputePinning, role_threads, thread_sleeps
from sluice.learner.balance import assign_to_ranks
from sluice.learner.checkpoint import load_rng, mark_acked, read_state, resolve_resume, save_checkpoint
from sluice.learner.dist import DistContext, init_dist, pick_device
from sluice.learner.leases import LeaseLedger
from sluice.learner.metrics import LearnerMetrics
from sluice.learner.source import BatchSource, FetchedBatch
from sluice.learner.trainer import Trainer
from sluice.learner.transfer import pack, unpack
from sluice.metrics import JsonlLog
from sluice.modeling.policy import materialize_policy_dir
from sluice.security import secure_context
from sluice.trajectory import Trajectory
from sluice.weight_sync.broadcaster import WeightBroadcaster

log = logging.getLogger(__name__)

STOP, TRAIN, SKIP = 0, 1, 2  # what rank 0 tells the group at the start of a step


@dataclass
class StepBatch:
    local: list[Trajectory] | None  # this rank's share (None: nothing to train this step)
    checkpoint_after: bool
    # rank 0 only:
    fetched: FetchedBatch | None = None
    trained: list[Trajectory] = field(default_factory=list)  # every rank's share together
    violations: int = 0
    lost_lineage: int = 0  # samples newer than this learner: made by weights a restart lost
    skipped: list[str] = field(default_factory=list)
    fetch_wait_s: float = 0.0
    scatter_s: float = 0.0

    def rank0_fetched(self) -> FetchedBatch:
        """The batch rank 0 fetched for this step (other ranks have none)."""
        if self.fetched is None:
            raise RuntimeError("this step has no fetched batch: only rank 0's steps carry one")
        return self.fetched


class Learner:
    def __init__(self, cfg: RunConfig, policy_id: str, stop: threading.Event) -> None:
        self.policy_id = policy_id
        self.cfg = cfg = policy_view(cfg, policy_id)
        self.suffix = role_suffix(cfg, policy_id)
        self.stop = stop
        lc = cfg.learner
        torch.set_num_threads(1)  # until `run` pins the training thread and starts the pool
        self.pinning = ComputePinning()
        torch.manual_seed(cfg.run.seed)
        # Before joining the group: with torch.distributed up, transformers' save_pretrained
        # writes nothing on ranks other than 0, so a rank building the directory would not.
        model_dir = materialize_policy_dir(cfg)
        self.dist: DistContext = init_dist(lc, pick_device(lc.device, int(os.environ.get("LOCAL_RANK", 0))))
        self.ckpt_root = checkpoint_root(cfg, policy_id)
        resume = resolve_resume(lc.resume, self.ckpt_root)
        state = read_state(resume) if resume is not None else {}
        self.trainer = Trainer(cfg, self.dist, model_dir, resume)
        if resume is not None:
            load_rng(resume, self.dist.rank, self.trainer.generator)
        self.version = int(state.get("version", 0))
        self.last_checkpoint = self.version if resume is not None else -1
        self.totals = {
            "samples": 0,
            "tokens": 0,
            "dropped_stale": 0,
            "violations": 0,
            "lost_lineage": 0,
            "skipped": 0,
            "episodes": 0,
            **state.get("totals", {}),
        }
        self.returns: deque[float] = deque(state.get("returns", []), maxlen=lc.return_window)
        self.metrics = LearnerMetrics(cfg, policy_id, self.dist.rank, self.version if resume else None)
        if self.dist.is_main:
            self._init_main(state, resumed=resume is not None)
        log.info(
            "learner %s rank %d/%d ready at version %d%s",
            policy_id,
            self.dist.rank,
            self.dist.world,
            self.version,
            f" (resumed from {resume})" if resume else "",
        )

    def _init_main(self, state: dict, resumed: bool) -> None:
        cfg, lc = self.cfg, self.cfg.learner
        client_ctx = secure_context(cfg.security, "client")  # None: plain sockets
        # once the learner is stopping, an ACK or NACK stops retrying a shard that does not
        # answer (its leases come back when they expire; a resumed learner settles them)
        self.buffer = BufferClient(cfg.buffer.all_endpoints(), ctx=client_ctx, should_abort=self.stop.is_set)
        self.ledger = LeaseLedger.from_state(state.get("leases", {}))
        if resumed:
            self._settle_resumed(state)
        admission = AdmissionPolicy(lc.batch_size, lc.max_staleness, started=self._admitted_already())
        self.control = ControlServer(
            cfg.control.bind_endpoint,
            admission,
            service_timeout_s=cfg.control.service_timeout_s,
            ctx=secure_context(cfg.security, "server"),
        )
        self.control.set_version(self.version)
        self.source = BatchSource(
            cfg.buffer.all_endpoints(),
            self.policy_id,
            lc,
            self.stop,
            cfg.buffer.lease_timeout_s,
            # Dropped samples give their admission quota back as each GET reports them: held
            # until the batch is complete they could starve it (with max_staleness 0, every
            # stale sample holds quota its replacement needs).
            on_dropped=self.control.release,
            on_returned=self.control.charge,
            ctx=client_ctx,
            # A new incarnation per start: the shards requeue what a crashed predecessor leased
            # at its first GET, instead of after buffer.lease_timeout_s.
            holder=Holder(f"learner/{self.policy_id}"),
        )
        self.broadcaster = WeightBroadcaster(
            cfg.weight_sync, self.dist.device, cfg.model.dtype, zmq_ctx=secure_context(cfg.security, "server")
        )
        self.audit = (
            JsonlLog(cfg.run_dir / "metrics" / f"consumed{self.suffix}.jsonl") if lc.audit_consumed else None
        )
        if self.audit is not None and resumed:
            self.audit.write({"resumed_from": self.version})

    def _admitted_already(self) -> int:
        """What the admission rule counts as started when this learner begins: the samples of
        the versions before it, and the backlog the shards hold for this policy (queued, or
        leased to a learner that died), which will be consumed or dropped (then released)
        before anything admitted now. Not counting the backlog after a resume let a full
        buffer's worth more be in flight than the bound for the rest of the run (each stale
        drop releasing its quota again): 64-384 stale drops per step, measured."""
        backlog = sum(
            (s.stats.get(f"backlog.{self.policy_id}", 0) for s in self.buffer.stats(missing_ok=True) if s),
            0,
        )
        if backlog:
            log.info("admission: the shards hold %d trajectories of %s already", backlog, self.policy_id)
        return self.version * self.cfg.learner.batch_size + backlog

    def _settle_resumed(self, state: dict) -> None:
        """The checkpoint lists the leases trained since the one before; ACK them unless the
        previous life did (acked.json), and never train again on those that were lost."""
        acked = state.get("acked")
        if acked is not None:  # (its pending steps: those whose shard was down then)
            self.ledger = LeaseLedger.from_state(acked)
            if not self.ledger.pending:
                return
        n, lost = self.ledger.settle(self.buffer)
        log.info("resume: ACKed %d trajectories of the checkpoint's leases, %d ids to skip", n, len(lost))

    # -- loop ----------------------------------------------------------------------------------

    def run(self) -> int:
        lc, ws = self.cfg.learner, self.cfg.weight_sync
        freeze_startup_heap()  # built: before the first publish lets the rollouts start
        retain_freed_memory()
        self.start()
        self.publish_weights()
        self.pinning.pin(role_threads(lc.torch_threads))  # the helpers have started by now
        while self.version < lc.total_steps:
            self.pinning.sweep()
            t0 = time.perf_counter()
            step = self.receive_batch()
            if step is None:
                break
            t1, cpu1, sleeps1 = time.perf_counter(), time.thread_time(), thread_sleeps()
            stats = self.trainer.train_step(step.local) if step.local is not None else {}
            t2, cpu2, sleeps2 = time.perf_counter(), time.thread_time(), thread_sleeps()
            if step.local is not None:
                self.version += 1
            self.consumed(step)
            sync_s = (
                self.publish_weights() if step.local is not None and self.version % ws.every == 0 else 0.0
            )
            if step.local is not None:  # before its checkpoint: that holds the step's line and totals
                self.record(
                    step,
                    stats,
                    wait_s=t1 - t0,
                    compute_s=t2 - t1,
                    compute_cpu_s=cpu2 - cpu1,
                    compute_sleeps=sleeps2 - sleeps1,
                    sync_s=sync_s,
                    step_s=time.perf_counter() - t0,
                )
            if step.checkpoint_after:
                self.checkpoint()
        if self.last_checkpoint != self.version:
            self.checkpoint()
        return 0

    def start(self) -> None:
        self.metrics.start()
        if self.dist.is_main:
            self.control.start()
            # membership (JOIN / LEAVE / SYNC_REPORT) runs on this learner's control plane
            self.broadcaster.start(self.control, self.cfg.control.endpoint, self.metrics.prom.registry)
            if self.version < self.cfg.learner.total_steps:
                self.source.request(self.version)

    # -- named steps ---------------------------------------------------------------------------

    def receive_batch(self) -> StepBatch | None:
        """Collective. Rank 0 takes the prefetched batch, checks it, splits it by tokens and
        scatters it; every rank returns its share (None: the run stops). A batch with nothing
        to train on (all too stale or already trained) comes back with `local=None`."""
        header, parts, step = [STOP, 0], None, None
        if self.dist.is_main:
            step, header, parts = self._take_and_split()
        t0 = time.perf_counter()
        action, checkpoint_after = self.dist.broadcast_ints(header, 2)
        if action == STOP:
            return None
        if action == SKIP:
            return step or StepBatch(local=None, checkpoint_after=bool(checkpoint_after))
        data = self.dist.scatter_bytes(parts)
        if step is None:
            return StepBatch(local=unpack(data), checkpoint_after=bool(checkpoint_after))
        step.scatter_s = time.perf_counter() - t0
        return step

    def _take_and_split(self):
        lc = self.cfg.learner
        t0 = time.perf_counter()
        fetched = None if self._should_stop() else self.source.take()
        if fetched is None:
            return None, [STOP, 0], None
        assert fetched.version == self.version
        self._settled(fetched)
        # Newer than this learner: generated, before a crash, by weights the resumed learner
        # never made (its checkpoint is older). Its versions will be made again, differently.
        current = fetched.current()
        fresh = [t for t in current if t.version >= fetched.min_version]
        trainable, skipped = self.ledger.filter(fresh)
        next_version = self.version + 1 if trainable else self.version
        if next_version < lc.total_steps:  # prefetch while this step trains; ACK what is due
            self.source.request(next_version, self.ledger.detach() if lc.checkpoint_every == 0 else [])
        due = lc.checkpoint_every > 0 and (
            (bool(trainable) and next_version % lc.checkpoint_every == 0)
            or self.ledger.oldest_age(reachable=self.buffer.reachable) > self.cfg.buffer.lease_timeout_s / 2
        )
        step = StepBatch(
            local=None,
            checkpoint_after=due,
            fetched=fetched,
            trained=trainable,
            violations=len(current) - len(fresh),
            lost_lineage=fetched.lost_lineage,
            skipped=skipped,
            fetch_wait_s=time.perf_counter() - t0,
        )
        if not trainable:
            return step, [SKIP, int(due)], None
        obj = self.trainer.objective
        costs = [obj.cost(t) for t in trainable]
        groups = [t.group_id for t in trainable] if obj.whole_groups else None
        shares = [[trainable[i] for i in ix] for ix in assign_to_ranks(costs, groups, self.dist.world)]
        step.local = shares[0]
        return step, [TRAIN, int(due)], [b""] + [pack(s) for s in shares[1:]]

    def _should_stop(self) -> bool:
        target = self.cfg.learner.target_return
        reached = (
            target is not None
            and len(self.returns) == self.returns.maxlen
            and float(np.mean(self.returns)) >= target
        )
        if reached:
            log.info("mean return of the last %d episodes reached %.1f: stopping", len(self.returns), target)
        return self.stop.is_set() or reached

    def _settled(self, fetched: FetchedBatch) -> None:
        """Apply what the ACKs that rode on `fetched`'s first GET found. Ids whose lease was gone
        (a shard restarted, a lease expired) are queued again after being consumed: admission
        counts them as started again (without it: 1,152 extra samples of quota after a shard
        kill, a stale surge of 64-704 drops a step to the end)."""
        if fetched.settled:
            self.control.charge(len(self.ledger.apply(fetched.settled, fetched.ack_outcomes)[1]))
        if fetched.deferred:  # a shard was down: ACKed on a later GET (or at the last checkpoint)
            self.ledger.undo(fetched.deferred)

    def consumed(self, step: StepBatch) -> None:
        """Rank 0: the step's leases join the ledger. With checkpoints off their ACKs ride on
        the GET of the batch after next (learner/source.py), else they wait for a checkpoint."""
        if not self.dist.is_main:
            return
        fetched = step.rank0_fetched()
        # Samples of the batch beyond the bound give their quota back only when the step makes
        # no version: a step that does advances the quota by a whole batch, these included
        # (released as well, they stayed in flight beyond the bound for the rest of the run: 64
        # stale drops per step after a resume, measured). A lost lineage's were leased beyond
        # the batch, and released as their GET brought them (learner/source.py).
        if not step.trained:
            self.control.release(step.violations)
        self.control.seen(samples_by_service(fetched.leased.trajs))
        self.ledger.add(fetched.leased, step.skipped, fetched.leased_at)
        if self.audit is not None:
            used = {t.traj_id for t in step.trained} | set(step.skipped)
            self.audit.write(
                {
                    "version": self.version,
                    "trained": [t.traj_id for t in step.trained],
                    "skipped": step.skipped,  # trained before (a lease lost at its ACK)
                    # beyond the staleness bound, or newer than this learner (a lost lineage's)
                    "dropped": [t.traj_id for t in fetched.leased.trajs if t.traj_id not in used],
                }
            )

    def _ack_trained(self) -> list[str]:
        """ACK the ledger's leases, those sent on a GET whose batch never came back too (ACK
        is idempotent). Ids whose lease was gone are charged again, as in `_settled`. Returns
        those ids. A step leased on a shard that is down, or that did not answer within the
        client's timeout, stays pending (`LeaseLedger.settle`): the checkpoint just written
        lists it, and the run goes on from the other shards."""
        self.ledger.undo(list(self.ledger.in_flight))
        try:
            lost = self.ledger.settle(self.buffer)[1]
        except ShardUnavailable as e:
            log.warning("v%d: ACKs not answered, their steps stay pending: %s", self.version, e)
            lost = []
        self.control.charge(len(lost))
        if self.ledger.pending:
            shards = self.ledger.pending_shards()
            down = sorted(k for k in shards if not self.buffer.reachable(k)) or sorted(shards)
            log.warning(
                "v%d: %d trained steps wait for shard %s to ACK their leases (down or not "
                "answering); every checkpoint lists them, so a resume ACKs them",
                self.version,
                len(self.ledger.pending),
                ", ".join(map(str, down)),
            )
        return lost

    def publish_weights(self) -> float:
        """Collective under ZeRO-3 (parameters are gathered); rank 0 broadcasts to the current
        members, late joiners pull this version's snapshot. A receiver that fails costs at most
        the weight-sync timeouts, never a hang."""
        t0 = time.perf_counter()
        with self.trainer.backend.full_params():
            if self.dist.is_main:
                stats = self.broadcaster.publish(self.version, self.trainer.model, self._weights_out)
                if stats.retried:
                    log.warning(
                        "weight sync v%d: group rebuilt during the publish (delivered=%s)",
                        stats.version,
                        stats.delivered,
                    )
        return time.perf_counter() - t0

    def _weights_out(self, version: int) -> None:
        """Every member verified `version` (called by the broadcaster, maybe from its
        confirmation thread): admission may now grant work on it."""
        self.control.set_published(version)
        self.control.set_version(version)

    def checkpoint(self) -> None:
        """Collective. Then rank 0 ACKs the leases whose effect the checkpoint holds."""
        started, state = time.perf_counter(), None
        if self.dist.is_main:
            self.metrics.flush()  # the log holds every step the checkpoint will
            state = {"totals": self.totals, "returns": list(self.returns), "leases": self.ledger.state_dict()}
        path = save_checkpoint(
            self.ckpt_root, self.version, self.trainer, self.dist, state, self.cfg.learner.keep_checkpoints
        )
        self.last_checkpoint = self.version
        if self.dist.is_main:
            lost = self._ack_trained()
            mark_acked(path, self.ledger.state_dict())
            log.info(
                "checkpoint v%d -> %s in %.2f s%s",
                self.version,
                path,
                time.perf_counter() - started,
                f" ({len(lost)} ids lost their lease)" if lost else "",
            )

    def record(self, step: StepBatch, stats: dict[str, float], **timing: float) -> None:
        if not self.dist.is_main:  # this rank's own timings, on its Prometheus endpoint
            self.metrics.step(self.version, {**timing, "wait_frac": timing["wait_s"] / timing["step_s"]})
            return
        s, lc = step, self.cfg.learner
        trained = s.trained
        lags = [self.version - 1 - t.version for t in trained]
        kind_llm = self.cfg.model.kind == "llm"
        tokens = sum(len(t.arrays["completion_ids"] if kind_llm else t.arrays["actions"]) for t in trained)
        for t in trained:
            if not kind_llm:
                self.returns.extend(float(r) for r in t.arrays["episode_returns"])
                self.totals["episodes"] += len(t.arrays["episode_returns"])
        self.totals["samples"] += len(trained)
        self.totals["tokens"] += tokens
        self.totals["dropped_stale"] += s.rank0_fetched().leased.dropped_stale
        self.totals["violations"] += s.violations
        self.totals["lost_lineage"] += s.lost_lineage
        self.totals["skipped"] += len(s.skipped)
        self.metrics.observe_staleness(lags)
        rewards = [t.reward for t in trained]
        record = {
            **stats,
            **timing,
            "loss": stats.get("policy_loss", 0.0),
            "fetch_wait_s": s.fetch_wait_s,
            "fetch_gets": s.rank0_fetched().gets,
            "scatter_s": s.scatter_s,
            "wait_frac": timing["wait_s"] / timing["step_s"],
            "samples": len(trained),
            "tokens": tokens,
            "samples_per_s": len(trained) / timing["step_s"],
            "tokens_per_s": tokens / timing["step_s"],
            "reward_mean": float(np.mean(rewards)),
            "reward_std": float(np.std(rewards, ddof=1)) if len(rewards) > 1 else 0.0,
            "staleness_mean": float(np.mean(lags)),
            "staleness_max": int(max(lags)),
            "staleness_hist": np.bincount(lags, minlength=lc.max_staleness + 1).tolist(),
            "dropped_stale": s.rank0_fetched().leased.dropped_stale,
            "staleness_violations": s.violations,
            "lost_lineage": s.lost_lineage,
            **{f"total_{k}": v for k, v in self.totals.items()},
        }
        if not kind_llm and self.returns:
            record["episode_return_mean"] = float(np.mean(self.returns))
        self.metrics.step(self.version, record)
        self.control.update_learner({k: float(v) for k, v in record.items() if isinstance(v, (int, float))})

    def close(self) -> None:
        if self.dist.is_main:
            # Shutdown goes out on the weight channel first: receivers LEAVE over the control
            # plane and rollouts leave their loops before the control server disappears.
            self.broadcaster.close()
            self.source.close()
            self.control.close()
            self.buffer.close()
            if self.audit is not None:
                self.audit.close()
        self.metrics.close()
        # DDP's reducer (inside the trainer) must be freed before its process group is
        # destroyed; the other order can hang the process at exit.
        del self.trainer
        self.dist.close()


def run_learner(cfg: RunConfig, stop: threading.Event, policy_id: str | None = None) -> int:
    learner = Learner(cfg, policy_id or cfg.learner.policies[0], stop)
    try:
        return learner.run()
    finally:
        learner.close()
