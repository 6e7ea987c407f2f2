"""The classic-RL objective: PPO / decoupled PPO with GAE, or V-trace, on env segments.

`prepare` runs the learner's current policy (the proximal policy) over the segments once,
without gradient: values of every state (and of the final states of truncated episodes),
log-probs of the taken actions. PPO then computes GAE advantages and returns, flattens the
segments into steps and shuffles them into minibatches. V-trace keeps whole segments (its
targets are recursions along time) and computes its targets inside the loss from the values
of the same forward pass, detached, as IMPALA does. PPO's policy term comes from the token-loss
table (learner/losses/registry.py), the steps of a minibatch being the tokens of one row.
Custom losses are for the token objective: a classic run with one is a config error
(sluice/config/loss.py, `check_objective`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from sluice.config.errors import ConfigError
from sluice.config.loss import (
    ClassicObjectiveConfig,
    DecoupledPPOLoss,
    LossConfig,
    PPOLoss,
    VTraceLoss,
    needs_proximal,
)
from sluice.learner.dist import DistContext
from sluice.learner.losses.aggregate import Denominator, aggregate, categorical_entropy
from sluice.learner.losses.base import TokenLossInputs
from sluice.learner.losses.ppo import gae, value_loss
from sluice.learner.losses.registry import TOKEN_LOSSES
from sluice.learner.losses.vtrace import vtrace_loss, vtrace_targets
from sluice.learner.objectives.base import Objective, Stats, rows, take_rows
from sluice.learner.stages.advantages import batch_whitened
from sluice.trajectory import Trajectory


@dataclass
class Segments:
    """B segments of T steps (time second)."""

    obs: torch.Tensor  # [B, T+1, D]
    actions: torch.Tensor  # [B, T]
    rewards: torch.Tensor  # [B, T]
    terminated: torch.Tensor  # [B, T] bool
    ended: torch.Tensor  # [B, T] bool, terminated or truncated
    behaviour_logprobs: torch.Tensor  # [B, T]
    final_obs: torch.Tensor  # [K, D] states truncated episodes were cut at
    final_pos: torch.Tensor  # [K, 2] (segment, step) of each final state

    @property
    def size(self) -> int:
        return len(self.actions)


@dataclass
class Steps:
    """N single steps with everything PPO needs (flattened, order free)."""

    obs: torch.Tensor  # [N, D]
    actions: torch.Tensor  # [N]
    behaviour_logprobs: torch.Tensor  # [N]
    proximal_logprobs: torch.Tensor  # [N]
    advantages: torch.Tensor  # [N]
    returns: torch.Tensor  # [N]
    old_values: torch.Tensor  # [N]

    @property
    def size(self) -> int:
        return len(self.actions)


def collate_segments(trajs: Sequence[Trajectory], device: torch.device) -> Segments:
    def stack(name, dtype):
        return torch.from_numpy(np.stack([np.asarray(t.arrays[name]) for t in trajs])).to(device, dtype)

    finals = [(b, int(i)) for b, t in enumerate(trajs) for i in t.arrays["final_index"]]
    final_obs = [np.asarray(t.arrays["final_obs"]) for t in trajs]
    dim = trajs[0].arrays["obs"].shape[-1]
    terminated = stack("terminated", torch.bool)
    return Segments(
        obs=stack("obs", torch.float32),
        actions=stack("actions", torch.long),
        rewards=stack("rewards", torch.float32),
        terminated=terminated,
        ended=terminated | stack("truncated", torch.bool),
        behaviour_logprobs=stack("behaviour_logprobs", torch.float32),
        final_obs=torch.from_numpy(np.concatenate(final_obs).reshape(-1, dim)).to(device, torch.float32),
        final_pos=torch.tensor(finals, dtype=torch.long, device=device).reshape(-1, 2),
    )


def evaluate(module, seg: Segments) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [B,T,A], values [B,T], next_values [B,T], log-probs of the actions [B,T]) under
    `module`; next_values[b, t] is V of the state after step t (the final state if truncated)."""
    logits, values = module(seg.obs)
    _, final_values = module(seg.final_obs)
    next_values = values[:, 1:].clone()
    if len(seg.final_pos):
        next_values[seg.final_pos[:, 0], seg.final_pos[:, 1]] = final_values
    logits = logits[:, :-1]
    logp = torch.log_softmax(logits, -1).gather(-1, seg.actions[..., None]).squeeze(-1)
    return logits, values[:, :-1], next_values, logp


class EnvObjective(Objective):
    whole_groups = False

    def __init__(
        self, loss: LossConfig, classic: ClassicObjectiveConfig, obs_dim: int, device: torch.device
    ) -> None:
        if not isinstance(loss, PPOLoss | DecoupledPPOLoss | VTraceLoss):
            raise ConfigError(
                f"config error: learner.loss.type: {loss.type!r} is not a classic-RL loss "
                "(ppo, decoupled_ppo, vtrace)"
            )
        self.cfg = loss
        self.classic = classic
        self.obs_dim = obs_dim
        self.device = device

    def cost(self, traj: Trajectory) -> int:
        return len(traj.arrays["actions"])

    def _dummy_segments(self) -> Segments:
        z = torch.zeros(1, 1, device=self.device)
        return Segments(
            obs=torch.zeros(1, 2, self.obs_dim, device=self.device),
            actions=z.long(),
            rewards=z,
            terminated=z.bool(),
            ended=z.bool(),
            behaviour_logprobs=z,
            final_obs=torch.zeros(0, self.obs_dim, device=self.device),
            final_pos=torch.zeros(0, 2, dtype=torch.long, device=self.device),
        )

    # -- prepare -------------------------------------------------------------------------------

    def prepare(self, module, trajs: Sequence[Trajectory], dist: DistContext):
        seg = collate_segments(trajs, self.device) if trajs else self._dummy_segments()
        empty = not trajs
        if isinstance(self.cfg, VTraceLoss):
            return (seg, empty)
        c = self.classic
        with torch.no_grad():
            _, values, next_values, logp = evaluate(module, seg)
            adv, ret = gae(seg.rewards, values, next_values, seg.terminated, seg.ended, c.gamma, c.gae_lambda)
            if c.normalize_advantages:
                adv = batch_whitened(adv, 0 if empty else adv.numel(), dist, eps=1e-8)
        proximal = logp if needs_proximal(self.cfg) else seg.behaviour_logprobs
        steps = Steps(
            obs=seg.obs[:, :-1].reshape(-1, self.obs_dim),
            actions=seg.actions.reshape(-1),
            behaviour_logprobs=seg.behaviour_logprobs.reshape(-1),
            proximal_logprobs=proximal.reshape(-1),
            advantages=adv.reshape(-1),
            returns=ret.reshape(-1),
            old_values=values.reshape(-1),
        )
        return (steps, empty)

    # -- pieces --------------------------------------------------------------------------------

    def split(self, batch, n: int, generator: torch.Generator):
        data, empty = batch
        if n == 1:
            return [batch]
        return [self._take(data, ix, empty) for ix in rows(data.size, n, generator)]

    def micro(self, batch, m: int):
        data, empty = batch
        if m == 1:
            return [batch]
        return [self._take(data, ix, empty) for ix in rows(data.size, m, None)]

    def _take(self, data, index: torch.Tensor, empty: bool):
        if empty or len(index) == 0:
            return (self._dummy_segments(), True) if isinstance(data, Segments) else self._empty_steps()
        if isinstance(data, Steps):
            return (Steps(**{f.name: getattr(data, f.name)[index] for f in fields(Steps)}), False)
        keep = torch.isin(data.final_pos[:, 0], index)
        remap = torch.full((data.size,), -1, dtype=torch.long, device=data.final_pos.device)
        remap[index] = torch.arange(len(index), device=remap.device)
        pos = data.final_pos[keep].clone()
        pos[:, 0] = remap[pos[:, 0]]
        per_row = {
            f.name: take_rows(getattr(data, f.name), index)
            for f in fields(Segments)
            if f.name not in ("final_obs", "final_pos")
        }
        per_row.update(final_obs=data.final_obs[keep], final_pos=pos)
        return (Segments(**per_row), False)

    def _empty_steps(self):
        z = torch.zeros(1, device=self.device)
        return (Steps(torch.zeros(1, self.obs_dim, device=self.device), z.long(), z, z, z, z, z), True)

    def counts(self, piece) -> tuple[float, float]:
        data, empty = piece
        if empty:
            return 0.0, 0.0
        if isinstance(data, Steps):
            return float(data.size), float(data.size)
        return float(data.actions.numel()), float(data.size)

    # -- loss ----------------------------------------------------------------------------------

    def loss(self, module, piece, denom: Denominator) -> tuple[torch.Tensor, Stats]:
        data, empty = piece
        if isinstance(data, Segments):
            loss, stats = self._vtrace(module, data, denom)
        else:
            loss, stats = self._ppo(module, data, denom)
        if empty:
            return loss * 0.0, {k: torch.zeros(()) for k in stats}
        return loss, stats

    def _vtrace(self, module, seg: Segments, denom: Denominator) -> tuple[torch.Tensor, Stats]:
        c, v = self.classic, self.cfg
        assert isinstance(v, VTraceLoss)
        logits, values, next_values, logp = evaluate(module, seg)
        targets = vtrace_targets(
            logp.detach(),
            seg.behaviour_logprobs,
            seg.rewards,
            values.detach(),
            next_values.detach(),
            seg.terminated,
            seg.ended,
            c.gamma,
            v.rho_bar,
            v.c_bar,
            v.trace_lambda,
        )
        mask = torch.ones_like(seg.rewards)
        out = vtrace_loss(
            logits, seg.actions, values, targets, mask, denom, v.rho_bar, c.value_coef, c.entropy_coef
        )
        return out.loss, dict(out.metrics)

    def _ppo(self, module, s: Steps, denom: Denominator) -> tuple[torch.Tensor, Stats]:
        c = self.classic
        logits, values = module(s.obs)
        logp = torch.log_softmax(logits, -1).gather(-1, s.actions[:, None]).squeeze(-1)
        row = lambda x: x[None]  # noqa: E731 - steps as one row of a [1, N] batch
        mask = torch.ones_like(row(s.advantages))
        x = TokenLossInputs(
            row(logp),
            row(s.behaviour_logprobs),
            row(s.proximal_logprobs),
            row(s.advantages),
            mask,
            "token",
            denom,
        )
        out = TOKEN_LOSSES[self.cfg.type](x, self.cfg)
        v_loss = value_loss(
            row(values), row(s.returns), mask, "token", denom, row(s.old_values), c.value_clip
        )
        entropy = aggregate(row(categorical_entropy(logits)), mask, "token", denom)
        loss = out.loss + c.value_coef * v_loss - c.entropy_coef * entropy
        stats = dict(out.metrics)
        stats.update(policy_loss=out.loss.detach(), value_loss=v_loss.detach(), entropy=entropy.detach())
        return loss, stats

    def max_stats(self) -> tuple[str, ...]:
        return ("is_weight_max",)
