"""The learner: receive a batch under the staleness bound, train, publish, acknowledge.

Version `v` = optimizer steps taken = the policy version rollouts tag their samples with.
The step that turns v into v+1 only consumes samples with `v - sample.version <=
max_staleness`: the buffer drops older ones when asked with `min_version = v - max_staleness`,
and this loop checks again (a safety net that counts, and never trains on, a violation).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

from buffer.client import BufferClient, LeasedBatch
from learner.batch import collate, token_logprobs
from learner.checkpoint import save_checkpoint
from learner.losses.grpo import group_advantages, group_indices, grpo_loss
from learner.metrics import LearnerMetrics
from sluice.config.run import RunConfig
from sluice.control.admission import AdmissionPolicy
from sluice.control.server import ControlServer
from sluice.modeling import load_policy, materialize_model_dir
from sluice.security import secure_context
from sluice.trajectory import Trajectory
from weight_sync.broadcaster import WeightBroadcaster

log = logging.getLogger(__name__)


def pick_device(kind: str) -> torch.device:
    if kind == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if hasattr(torch, "npu") and torch.npu.is_available():  # type: ignore[attr-defined]
            return torch.device("npu")
        return torch.device("cpu")
    return torch.device(kind)


@dataclass
class ReceivedBatch:
    trajs: list[Trajectory]
    leased: LeasedBatch
    wait_s: float
    dropped_stale: int
    violations: int  # samples the buffer let through although too stale (never trained on)


class Learner:
    def __init__(self, cfg: RunConfig, stop: threading.Event) -> None:
        self.cfg = cfg
        self.stop = stop
        lc = cfg.learner
        torch.set_num_threads(lc.torch_threads)
        torch.manual_seed(cfg.run.seed)
        self.device = pick_device(lc.device)
        model_dir = materialize_model_dir(cfg.model, cfg.run_dir)
        self.model, self.tokenizer = load_policy(model_dir, cfg.model.dtype, self.device)
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lc.lr, betas=lc.betas, weight_decay=lc.weight_decay
        )
        self.version = 0
        self.buffer = BufferClient(cfg.buffer.all_endpoints(), ctx=secure_context(cfg.security, "client"))
        self.broadcaster = WeightBroadcaster(cfg.weight_sync, self.device, cfg.model.dtype)
        self.metrics = LearnerMetrics(cfg)
        self.control = ControlServer(
            cfg.control.bind_endpoint,
            AdmissionPolicy(lc.batch_size, lc.max_staleness),
            service_timeout_s=cfg.control.service_timeout_s,
            ctx=secure_context(cfg.security, "server"),
        )
        self.totals = {"samples": 0, "tokens": 0, "dropped_stale": 0, "violations": 0}

    # -- named steps ---------------------------------------------------------------------------

    def receive_batch(self) -> ReceivedBatch | None:
        """Lease whole groups until batch_size trajectories, none older than the bound."""
        lc = self.cfg.learner
        min_version = self.version - lc.max_staleness
        leased = LeasedBatch()
        t0 = time.perf_counter()
        while len(leased.trajs) < lc.batch_size:
            if self.stop.is_set():
                if leased.leases:
                    self.buffer.nack(leased)
                return None
            part = self.buffer.get(
                lc.batch_size - len(leased.trajs), min_version=min_version, wait_ms=lc.get_wait_ms
            )
            # Dropped samples give their admission quota back at once: held until the batch
            # is complete, they could starve it (with max_staleness 0, every stale sample
            # holds quota the replacement needs).
            self.control.release(part.dropped_stale)
            leased.extend(part)
        fresh = [t for t in leased.trajs if t.version >= min_version]
        return ReceivedBatch(
            trajs=fresh,
            leased=leased,
            wait_s=time.perf_counter() - t0,
            dropped_stale=leased.dropped_stale,
            violations=len(leased.trajs) - len(fresh),
        )

    def train_step(self, trajs: list[Trajectory]) -> dict[str, float]:
        lc = self.cfg.learner
        batch = collate(trajs, self.tokenizer.pad_token_id)
        batch = _to_device(batch, self.device)
        adv = group_advantages(
            batch.rewards.cpu(),
            group_indices(batch.group_ids),
            eps=lc.loss.adv_eps,
            normalize_std=lc.loss.normalize_std,
        ).to(self.device)
        logp = token_logprobs(self.model, batch, self.cfg.rollout.temperature)
        out = grpo_loss(logp, batch.behaviour_logprobs, adv, batch.completion_mask, lc.loss.is_cap)
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), lc.grad_clip)
        self.optimizer.step()
        staleness = (self.version - batch.versions).float()
        return {
            "loss": float(out.loss.detach()),
            "grad_norm": float(grad_norm),
            "is_weight_mean": out.is_weight_mean,
            "is_truncated_frac": out.is_truncated_frac,
            "log_ratio_abs_mean": out.log_ratio_abs_mean,
            "reward_mean": float(batch.rewards.mean()),
            "reward_std": float(batch.rewards.std()) if len(trajs) > 1 else 0.0,
            "staleness_mean": float(staleness.mean()),
            "staleness_max": float(staleness.max()),
            "samples": len(trajs),
            "tokens": batch.n_tokens,
        }

    def publish_weights(self) -> float:
        """Broadcast to the current members; late joiners pull this version's snapshot. A
        receiver that fails costs at most the weight-sync timeouts, never a hang."""
        stats = self.broadcaster.publish(self.version, self.model)
        self.control.set_published(self.version)
        if stats.retried:
            log.warning(
                "weight sync v%d: group rebuilt during the publish (delivered=%s)",
                stats.version,
                stats.delivered,
            )
        return stats.seconds

    def checkpoint(self) -> None:
        path = save_checkpoint(
            self.cfg.run_dir, self.version, self.model, self.tokenizer, self.optimizer, dict(self.totals)
        )
        log.info("checkpoint v%d -> %s", self.version, path)

    # -- loop ----------------------------------------------------------------------------------

    def run(self) -> int:
        lc, ws = self.cfg.learner, self.cfg.weight_sync
        self.metrics.start()
        self.control.start()
        self.broadcaster.start(  # membership (JOIN / LEAVE / SYNC_REPORT) on our control plane
            self.control, self.cfg.control.endpoint, self.metrics.prom.registry
        )
        self.publish_weights()
        while self.version < lc.total_steps and not self.stop.is_set():
            t0 = time.perf_counter()
            received = self.receive_batch()
            if received is None:
                break
            self.control.release(received.violations)
            t1 = time.perf_counter()
            stats = self.train_step(received.trajs) if received.trajs else {}
            t2 = time.perf_counter()
            self.version += 1
            self.buffer.ack(received.leased)
            sync_s = self.publish_weights() if self.version % ws.every == 0 else 0.0
            self.control.set_version(self.version)  # admits new work once its weights are out
            t3 = time.perf_counter()
            self._account(received, stats)
            step_s = t3 - t0
            record = {
                **stats,
                "wait_s": t1 - t0,
                "compute_s": t2 - t1,
                "sync_s": sync_s,
                "step_s": step_s,
                "wait_frac": (t1 - t0) / step_s,
                "samples_per_s": stats.get("samples", 0) / step_s,
                "dropped_stale": received.dropped_stale,
                "staleness_violations": received.violations,
                **{f"total_{k}": v for k, v in self.totals.items()},
            }
            self.metrics.step(self.version, record)
            self.control.update_learner({k: float(v) for k, v in record.items()})
            if lc.checkpoint_every and self.version % lc.checkpoint_every == 0:
                self.checkpoint()
        self.checkpoint()
        return 0

    def _account(self, received: ReceivedBatch, stats: dict[str, float]) -> None:
        self.totals["samples"] += int(stats.get("samples", 0))
        self.totals["tokens"] += int(stats.get("tokens", 0))
        self.totals["dropped_stale"] += received.dropped_stale
        self.totals["violations"] += received.violations

    def close(self) -> None:
        self.broadcaster.close()  # first: receivers LEAVE over the control plane
        self.control.close()
        self.buffer.close()
        self.metrics.close()


def _to_device(batch, device: torch.device):
    if device.type == "cpu":
        return batch
    for name, value in vars(batch).items():
        if isinstance(value, torch.Tensor):
            setattr(batch, name, value.to(device))
    return batch


def run_learner(cfg: RunConfig, stop: threading.Event) -> int:
    learner = Learner(cfg, stop)
    try:
        return learner.run()
    finally:
        learner.close()
