"""The LLM objective: GRPO, PPO, decoupled PPO or a user's loss on token sequences, optional
KL to the initial weights.

Advantages are group-normalised rewards (GRPO) computed on the rank, which holds whole
groups. The proximal log-probs of decoupled PPO are the learner's own log-probs before the
batch's first update (`recompute_proximal`), else the behaviour log-probs. The reference
policy of the KL penalty is the run's initial model, kept frozen on every rank. The loss is
called through the table of learner/losses/registry.py with the inputs of
learner/losses/base.py, whichever loss `learner.loss.type` names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from sluice.config.loss import LLMObjectiveConfig, LossConfig, needs_proximal
from sluice.learner.balance import balance
from sluice.learner.batch import TokenBatch, collate, token_logprobs
from sluice.learner.dist import DistContext
from sluice.learner.losses.aggregate import Denominator
from sluice.learner.losses.base import TokenLossInputs
from sluice.learner.losses.grpo import group_advantages, group_indices
from sluice.learner.losses.kl import kl_penalty
from sluice.learner.losses.registry import token_loss
from sluice.learner.objectives.base import Objective, Stats, rows, take_rows
from sluice.modeling.sampling import SamplingTransform
from sluice.trajectory import Trajectory


@dataclass
class TokenPiece:
    batch: TokenBatch
    advantages: torch.Tensor  # [B]
    proximal: torch.Tensor | None  # [B, L-1] log pi_prox(target), when the loss asks for it
    reference: torch.Tensor | None  # [B, L-1] log pi_ref(target), KL penalty only
    empty: bool = False  # a dummy row standing in for no data (zero weight)


class TokenObjective(Objective[TokenPiece]):
    whole_groups = True

    def __init__(
        self,
        loss: LossConfig,
        pad_id: int,
        bos_id: int,
        sampling: SamplingTransform,
        device: torch.device,
        reference_dir: Path | None = None,
        dtype: str = "float32",
        *,
        llm: LLMObjectiveConfig,
    ) -> None:
        self.cfg = loss
        self.llm = llm
        self.loss_fn, self.loss_params = token_loss(loss)
        self.pad_id = pad_id
        self.bos_id = bos_id
        self.sampling = sampling
        self.device = device
        self.reference = None
        if llm.kl_coef > 0:
            from sluice.modeling import load_policy

            assert reference_dir is not None
            self.reference, _ = load_policy(reference_dir, dtype, device)
            self.reference.eval().requires_grad_(False)

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
        batch = collate(list(trajs) or [self._dummy()], self.pad_id)
        batch = _to(batch, self.device)
        if empty:
            batch.completion_mask = torch.zeros_like(batch.completion_mask)
        adv = group_advantages(
            batch.rewards.cpu(), group_indices(batch.group_ids), self.llm.adv_eps, self.llm.normalize_std
        ).to(self.device)
        proximal = reference = None
        with torch.no_grad():
            if needs_proximal(self.cfg):
                proximal = token_logprobs(module, batch, self.sampling)
            if self.reference is not None:
                reference = token_logprobs(self.reference, batch, self.sampling)
        return TokenPiece(batch, adv, proximal, reference, empty)

    # -- pieces --------------------------------------------------------------------------------

    def split(self, piece: TokenPiece, n: int, generator: torch.Generator) -> list[TokenPiece]:
        if n == 1:
            return [piece]
        return [self._take(piece, ix) for ix in rows(len(piece.advantages), n, generator)]

    def micro(self, piece: TokenPiece, m: int) -> list[TokenPiece]:
        if m == 1:
            return [piece]
        lengths = piece.batch.attention_mask.sum(-1).tolist() if not piece.empty else []
        return [self._take(piece, torch.tensor(ix, dtype=torch.long)) for ix in balance(lengths, m)]

    def _take(self, piece: TokenPiece, index: torch.Tensor) -> TokenPiece:
        if piece.empty or len(index) == 0:
            return self.prepare_dummy()
        batch = TokenBatch(
            **{f.name: take_rows(getattr(piece.batch, f.name), index) for f in fields(TokenBatch)}
        )
        width = int(batch.attention_mask.sum(-1).max())  # drop columns that are padding in every row
        trim = {
            "input_ids": width,
            "attention_mask": width,
            "targets": width - 1,
            "completion_mask": width - 1,
            "behaviour_logprobs": width - 1,
        }
        batch = replace(batch, **{k: getattr(batch, k)[:, :w] for k, w in trim.items()})

        def cut(x):
            return None if x is None else x[index][:, : width - 1]

        return TokenPiece(batch, piece.advantages[index], cut(piece.proximal), cut(piece.reference))

    def prepare_dummy(self) -> TokenPiece:
        """A one-row piece with nothing to learn from (its loss is multiplied by 0)."""
        batch = _to(collate([self._dummy()], self.pad_id), self.device)
        batch.completion_mask = torch.zeros_like(batch.completion_mask)
        zeros = torch.zeros_like(batch.behaviour_logprobs)
        return TokenPiece(batch, torch.zeros(1, device=self.device), zeros, zeros, empty=True)

    def counts(self, piece: TokenPiece) -> tuple[float, float]:
        if piece.empty:
            return 0.0, 0.0
        return float(piece.batch.completion_mask.sum()), float(len(piece.advantages))

    # -- loss ----------------------------------------------------------------------------------

    def loss(self, module, piece: TokenPiece, denom: Denominator) -> tuple[torch.Tensor, Stats]:
        llm, b = self.llm, piece.batch
        logp = token_logprobs(module, b, self.sampling)
        mask = b.completion_mask
        x = TokenLossInputs(
            logp, b.behaviour_logprobs, piece.proximal, piece.advantages, mask, llm.aggregation, denom
        )
        out = self.loss_fn(x, self.loss_params)
        loss = out.loss
        stats: Stats = dict(out.metrics)
        stats["policy_loss"] = loss.detach()
        if piece.reference is not None and llm.kl_coef > 0:
            kl = kl_penalty(logp, piece.reference, mask, llm.kl_estimator, llm.aggregation, denom)
            loss = loss + llm.kl_coef * kl
            stats["kl_ref"] = kl.detach()
        if piece.empty:
            loss = loss * 0.0
            stats = {k: torch.zeros_like(v) for k, v in stats.items()}
        return loss, stats

    def max_stats(self) -> tuple[str, ...]:
        return ("is_weight_max",)


def _to(batch: TokenBatch, device: torch.device) -> TokenBatch:
    if device.type == "cpu":
        return batch
    for f in fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor):
            setattr(batch, f.name, value.to(device))
    return batch
