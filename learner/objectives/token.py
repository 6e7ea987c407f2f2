"""The LLM objective: runs a workflow's learner stages (sluice/config/workflow.py) on token
sequences.

`prepare` collates a rank's trajectories (whole groups) into fields and runs the prepare
stages without gradient (proximal and reference log-probs, advantages); `loss` computes the
policy's log-probs of a micro-batch and sums the loss stages' terms (policy loss, KL, a
user's). The stages and the fields they read and write are in learner/stages/; the reference
policy is the run's initial model, kept frozen, loaded only when a stage reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from sluice.learner.balance import balance
from sluice.learner.batch import TokenBatch, collate, token_logprobs_and_entropy
from sluice.learner.critic import Critic
from sluice.learner.dist import DistContext
from sluice.learner.losses.aggregate import Denominator
from sluice.learner.losses.grpo import group_indices
from sluice.learner.objectives.base import Objective, Stats, rows, take_rows
from sluice.learner.packing import PackedRows, plan
from sluice.learner.stages.base import Fields, LossContext, PrepareContext
from sluice.learner.stages.builtin import (
    build_stages,
    critic_config,
    needs_entropy,
    needs_reference,
    zero_at_zero_advantage,
)
from sluice.modeling.sampling import SamplingTransform
from sluice.trajectory import Trajectory


@dataclass
class TokenPiece:
    batch: TokenBatch  # input ids, masks and targets for the policy's forward
    fields: Fields  # per sequence [B] or per target [B, L-1] (learner/stages/base.py)
    empty: bool = False  # a dummy row standing in for no data (zero weight)


class TokenObjective(Objective[TokenPiece]):
    whole_groups = True

    def __init__(
        self,
        stages: Sequence[Any],
        pad_id: int,
        bos_id: int,
        sampling: SamplingTransform,
        device: torch.device,
        reference_dir: Path | None = None,
        dtype: str = "float32",
        grad_clip: float = 1.0,
        dist: DistContext | None = None,
        pack_attention: float | None = None,
        skip_zero_advantage: bool = False,
    ) -> None:
        """`stages`: `workflow.learner` (sluice.config.workflow_check.effective_workflow);
        `reference_dir`: the run's initial model (the KL reference and the critic's start);
        `dist`: the learner group (a group of one if None), for the critic's updates;
        `pack_attention`: pack sequences for the forward (learner/packing.py), with this
        attention weight per key in the row-width choice; None: right-padded rows;
        `skip_zero_advantage`: leave rows without gradient out of the step, where the loss
        stages allow it (`without_inert`)."""
        self.prepare_stages, self.loss_stages = build_stages(stages)
        # each loss stage's aggregation, where rows whose advantage is 0 have no gradient
        self.inert_modes = zero_at_zero_advantage(stages) if skip_zero_advantage else None
        self.entropy = needs_entropy(stages)  # the loss forward also gives the entropy field
        self.pad_id = pad_id
        self.bos_id = bos_id
        self.sampling = sampling
        self.device = device
        self.critic = self._build_critic(stages, reference_dir, dtype, grad_clip)
        self.dist = dist or DistContext()
        self.pack_attention = pack_attention
        self.reference = None
        if needs_reference(stages):
            from sluice.modeling import load_policy

            assert reference_dir is not None
            self.reference, _ = load_policy(reference_dir, dtype, device)
            self.reference.eval().requires_grad_(False)

    def _build_critic(self, stages, model_dir: Path | None, dtype: str, grad_clip: float) -> Critic | None:
        cfg = critic_config(stages)
        if cfg is None:
            return None
        assert model_dir is not None, "a critic starts from the run's initial model"
        return Critic(model_dir, dtype, self.device, cfg.lr, grad_clip)

    def after_update(self) -> dict[str, float]:
        if self.critic is None:
            return {}
        return {"critic_grad_norm": self.critic.step(self.dist)}

    def save(self, directory: Path) -> None:
        if self.critic is not None:
            self.critic.save(directory, self.dist)

    def load(self, directory: Path) -> None:
        if self.critic is not None:
            self.critic.load(directory)

    def cost(self, traj: Trajectory) -> int:
        return len(traj.arrays["prompt_ids"]) + len(traj.arrays["completion_ids"])

    # -- prepare -------------------------------------------------------------------------------

    def _dummy(self) -> Trajectory:
        import numpy as np

        return Trajectory(
            traj_id="dummy",
            group_id="dummy",
            version=0,
            arrays={
                "prompt_ids": np.asarray([self.bos_id], dtype=np.int32),
                "completion_ids": np.asarray([self.bos_id], dtype=np.int32),
                "behaviour_logprobs": np.zeros(1, dtype=np.float32),
            },
        )

    def prepare(self, module, trajs: Sequence[Trajectory], dist: DistContext) -> TokenPiece:
        empty = not trajs
        batch = _to(self._packed(collate(list(trajs) or [self._dummy()], self.pad_id)), self.device)
        if empty:
            batch.completion_mask = torch.zeros_like(batch.completion_mask)
        data: Fields = {
            "behaviour_logprobs": batch.behaviour_logprobs,
            "mask": batch.completion_mask,
            "rewards": batch.rewards,
            "group_index": group_indices(batch.group_ids).to(self.device),
            "versions": batch.versions,
            "truncated": batch.truncated
            if batch.truncated is not None
            else torch.zeros(len(batch.group_ids)),
        }
        ctx = PrepareContext(module, self.reference, batch, self.sampling, dist, empty, self.critic)
        with torch.no_grad():
            for stage in self.prepare_stages:
                data.update(stage.run(data, ctx))
        return TokenPiece(batch, data, empty)

    # -- pieces --------------------------------------------------------------------------------

    def split(self, piece: TokenPiece, n: int, generator: torch.Generator) -> list[TokenPiece]:
        if n == 1:
            return [piece]
        return [self._take(piece, ix) for ix in rows(len(piece.batch.group_ids), n, generator)]

    def micro(self, piece: TokenPiece, m: int) -> list[TokenPiece]:
        if m == 1:
            return [piece]
        lengths = piece.batch.attention_mask.sum(-1).tolist() if not piece.empty else []
        return [self._take(piece, torch.tensor(ix, dtype=torch.long)) for ix in balance(lengths, m)]

    def _take(self, piece: TokenPiece, index: torch.Tensor) -> TokenPiece:
        """Rows `index` of every tensor, cut to the widest of those rows (columns that are
        padding in every row are dropped)."""
        if piece.empty or len(index) == 0:
            return self._dummy_piece(piece.fields)
        batch = TokenBatch(
            **{f.name: take_rows(getattr(piece.batch, f.name), index) for f in fields(TokenBatch)}
        )
        width = int(batch.attention_mask.sum(-1).max())
        trim = {"input_ids": width, "attention_mask": width}
        trim |= dict.fromkeys(("targets", "completion_mask", "behaviour_logprobs"), width - 1)
        batch = self._packed(replace(batch, **{k: getattr(batch, k)[:, :w] for k, w in trim.items()}))
        data = {k: v[index][:, : width - 1] if v.dim() == 2 else v[index] for k, v in piece.fields.items()}
        return TokenPiece(batch, data)

    def _packed(self, batch: TokenBatch) -> TokenBatch:
        """`batch` with its packed layout, where packing is on and computes fewer positions."""
        if self.pack_attention is None:
            return batch
        batch.packed = plan(batch.input_ids, batch.attention_mask, self.pad_id, self.pack_attention)
        return batch

    def _dummy_piece(self, like: Fields) -> TokenPiece:
        """A one-row piece with nothing to learn from (its loss is multiplied by 0), with zeros
        for each of `like`'s fields, so every loss stage runs the same ops on every rank."""
        batch = _to(collate([self._dummy()], self.pad_id), self.device)
        batch.completion_mask = torch.zeros_like(batch.completion_mask)
        row = batch.behaviour_logprobs
        data = {
            k: torch.zeros((1, row.shape[1]) if v.dim() == 2 else (1,), dtype=v.dtype, device=v.device)
            for k, v in like.items()
        }
        data["mask"] = batch.completion_mask
        return TokenPiece(batch, data, empty=True)

    def without_inert(self, piece: TokenPiece) -> TokenPiece | None:
        """`piece` without its rows whose advantage is 0 at every trained token (or that have no
        trained token): under a built-in policy loss their gradient is exactly 0, so the
        forward and backward of the rest give the same update (`Denominator.share` keeps
        their weight). None: nothing to leave out, or the workflow's loss has gradient there."""
        if self.inert_modes is None or piece.empty:
            return None
        adv, mask = piece.fields["advantages"], piece.fields["mask"].bool()
        nonzero = adv != 0 if adv.dim() == 1 else ((adv != 0) & mask).any(-1)
        keep = nonzero & mask.any(-1)
        if bool(keep.all()):
            return None
        return self._take(piece, keep.nonzero().squeeze(-1).cpu())

    def counts(self, piece: TokenPiece) -> tuple[float, float]:
        if piece.empty:
            return 0.0, 0.0
        return float(piece.fields["mask"].sum()), float(len(piece.batch.group_ids))

    # -- loss ----------------------------------------------------------------------------------

    def loss(self, module, piece: TokenPiece, denom: Denominator) -> tuple[torch.Tensor, Stats]:
        logprobs, entropy = token_logprobs_and_entropy(module, piece.batch, self.sampling, self.entropy)
        data = {**piece.fields, "logprobs": logprobs}
        if entropy is not None:
            data["entropy"] = entropy
        ctx = LossContext(denom, piece.batch, self.critic)
        total = torch.zeros((), device=data["logprobs"].device)
        stats: Stats = {}
        for i, stage in enumerate(self.loss_stages):
            out = stage.run(data, ctx)
            # a mean over the rows kept, weighed as the whole minibatch's (1 when none left out)
            term = out.loss * denom.share(self.inert_modes[i]) if self.inert_modes else out.loss
            total = total + stage.coef * term
            stats.update(out.metrics)
            stats[stage.name] = term.detach()
        stats |= _forward_size(piece.batch, total.device)
        if piece.empty:
            total = total * 0.0
            stats = {k: torch.zeros_like(v) for k, v in stats.items()}
        return total, stats

    def max_stats(self) -> tuple[str, ...]:
        return ("is_weight_max",)


def _forward_size(batch: TokenBatch, device: torch.device) -> Stats:
    """The tokens in the policy's forward and the positions it computed (packed rows, or the
    padded batch): their ratio is the `forward_fill` metric."""
    shape = (batch.packed.input_ids if batch.packed is not None else batch.input_ids).shape
    return {
        "forward_tokens": batch.attention_mask.sum().to(device, torch.float32),
        "forward_positions": torch.tensor(float(shape[0] * shape[1]), device=device),
    }


def _to(batch: TokenBatch, device: torch.device) -> TokenBatch:
    if device.type == "cpu":
        return batch
    for f in fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, (torch.Tensor, PackedRows)):
            setattr(batch, f.name, value.to(device))
    return batch
