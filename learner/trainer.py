"""One learner step on this rank's share of the batch: prepare, then `epochs x minibatches`
optimizer updates, each accumulated over `micro_batches` micro-batches.

Every rank runs the same sequence of forwards, backwards and updates (pieces without data are
zero-weighted dummies), so DDP's all-reduce and ZeRO's reduce-scatter/gather line up. Loss
terms are shares of global means (learner/losses/aggregate.py): the statistics are summed
over micro-batches and ranks, then averaged over updates.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from sluice.config.run import RunConfig
from sluice.config.workflow import ActorCritic
from sluice.config.workflow_check import effective_workflow
from sluice.learner.backends import TrainBackend, build_backend
from sluice.learner.dist import DistContext
from sluice.learner.losses.aggregate import Denominator
from sluice.learner.objectives.base import Objective
from sluice.modeling.policy import load_policy_model
from sluice.trajectory import Trajectory

log = logging.getLogger(__name__)


def build_objective(
    cfg: RunConfig,
    model: torch.nn.Module,
    tokenizer,
    model_dir: Path,
    device,
    dist: DistContext | None = None,
) -> Objective:
    """The objective that runs the run's workflow (sluice/config/workflow.py)."""
    workflow = effective_workflow(cfg)
    if cfg.model.kind == "mlp":
        from sluice.learner.objectives.env import EnvObjective
        from sluice.modeling.mlp import MLPPolicy

        if not isinstance(model, MLPPolicy):
            raise TypeError(f"model.kind mlp: expected an MLPPolicy, loaded a {type(model).__name__}")
        (stage,) = workflow.learner  # checked at load: one actor_critic stage
        assert isinstance(stage, ActorCritic)
        return EnvObjective(stage.loss, stage.classic, model.config.obs_dim, device)
    from sluice.learner.objectives.token import TokenObjective
    from sluice.modeling.sampling import SamplingTransform

    return TokenObjective(
        workflow.learner,
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        SamplingTransform.of(cfg.rollout),
        device,
        reference_dir=model_dir,
        dtype=cfg.model.dtype,
        grad_clip=cfg.learner.grad_clip,
        dist=dist,
        pack_attention=pack_attention(cfg, model, tokenizer, device),
        skip_zero_advantage=cfg.learner.skip_zero_advantage,
    )


def pack_attention(cfg: RunConfig, model: torch.nn.Module, tokenizer, device) -> float | None:
    """The packing's attention weight (learner/packing.py), or None: padded rows, where
    `learner.pack_sequences` is off or the model's packed forward differs from its padded one."""
    from sluice.learner.packing import attention_weight, packs_like_padding

    if not cfg.learner.pack_sequences:
        return None
    tolerance = 1e-3 if cfg.model.dtype == "float32" else 3e-2
    vocab = len(tokenizer)
    if not packs_like_padding(model, tokenizer.pad_token_id, vocab, torch.device(device), tolerance):
        name = type(model).__name__
        log.warning("learner.pack_sequences: %s's packed forward differs from its padded one; padding", name)
        return None
    return attention_weight(model)


class Trainer:
    def __init__(
        self, cfg: RunConfig, dist: DistContext, model_dir: Path, resume_dir: Path | None = None
    ) -> None:
        lc = cfg.learner
        self.cfg = cfg
        self.dist = dist
        model, self.tokenizer = load_policy_model(cfg, resume_dir or model_dir, dist.device)
        model.train()
        self.objective = build_objective(cfg, model, self.tokenizer, model_dir, dist.device, dist)
        total_updates = lc.total_steps * lc.epochs * lc.minibatches
        self.backend: TrainBackend = build_backend(lc, model, dist, total_updates, cfg.model.dtype)
        if resume_dir is not None:
            self.backend.load(resume_dir)
            self.objective.load(resume_dir)
        self.generator = torch.Generator().manual_seed(cfg.run.seed * 1000 + dist.rank)

    @property
    def model(self) -> torch.nn.Module:
        return self.backend.model

    def train_step(self, trajs: Sequence[Trajectory]) -> dict[str, float]:
        lc, obj, be = self.cfg.learner, self.objective, self.backend
        prepared = obj.prepare(be.module, trajs, self.dist)
        # Statistics stay where the loss is until the step ends: one host copy per step, not
        # one sync per statistic and micro-batch (each a device sync on an accelerator).
        sums: dict[str, torch.Tensor] = {}
        maxima: dict[str, torch.Tensor] = {}
        norms = []
        extra: dict[str, float] = {}  # the last update's statistics of what else the objective trains
        inert = 0.0  # share of the minibatches' tokens left out (no gradient), summed over updates
        for _ in range(lc.epochs):
            for minibatch in obj.split(prepared, lc.minibatches, self.generator):
                kept = obj.without_inert(minibatch)
                pieces = obj.micro(minibatch if kept is None else kept, lc.micro_batches)
                denom = self.global_denominator(minibatch, pieces)
                inert += 1.0 - denom.share("token")
                for i, piece in enumerate(pieces):
                    with be.accumulate(sync=i == len(pieces) - 1):
                        loss, stats = obj.loss(be.module, piece, denom)
                        be.backward(loss)
                    for k, v in stats.items():
                        v = v.detach().double()
                        if k in obj.max_stats():
                            maxima[k] = torch.maximum(maxima[k], v) if k in maxima else v
                        else:
                            sums[k] = sums[k] + v if k in sums else v
                norms.append(be.step())
                extra = obj.after_update()
        stats = self.reduce_stats(sums, maxima, updates=lc.epochs * lc.minibatches)
        stats["inert_frac"] = inert / (lc.epochs * lc.minibatches)
        if stats.get("forward_positions"):  # share of computed positions holding a token
            stats["forward_fill"] = stats["forward_tokens"] / stats["forward_positions"]
        return (
            stats
            | extra
            | {
                "grad_norm": float(torch.stack([torch.as_tensor(n).double().cpu() for n in norms]).mean()),
                "lr": be.lr(),
            }
        )

    def global_denominator(self, minibatch, pieces) -> Denominator:
        """The counts of the pieces trained, over all ranks, and of the whole minibatch where
        rows were left out of them (`Objective.without_inert`): one all-reduce."""
        whole = self.objective.counts(minibatch)
        kept = [sum(self.objective.counts(p)[i] for p in pieces) for i in (0, 1)]
        totals = self.dist.all_reduce(torch.tensor([*kept, *whole], dtype=torch.float64)).tolist()
        tokens, sequences, whole_tokens, whole_sequences = totals
        if (tokens, sequences) == (whole_tokens, whole_sequences):
            return Denominator(tokens=tokens, sequences=sequences)
        return Denominator(tokens, sequences, whole_tokens, whole_sequences)

    def reduce_stats(self, sums, maxima, updates: int) -> dict[str, float]:
        names = sorted(sums)
        out: dict[str, float] = {}
        if names:
            total = self.dist.all_reduce(torch.stack([sums[k] for k in names]).cpu())
            out.update({k: float(v) / updates for k, v in zip(names, total)})
        names = sorted(maxima)
        if names:
            top = self.dist.all_reduce(torch.stack([maxima[k] for k in names]).cpu(), op="max")
            out.update({k: float(v) for k, v in zip(names, top)})
        return out
