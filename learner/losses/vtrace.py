"""V-trace (IMPALA, Espeholt et al. 2018): off-policy value targets and actor-critic loss.

For a segment x_0 .. x_T of one actor, behaviour policy mu, learner policy pi:
    rho_t = min(rho_bar, pi(a_t|x_t) / mu(a_t|x_t))
    c_t   = lambda * min(c_bar, pi(a_t|x_t) / mu(a_t|x_t))
    delta_t = rho_t * (r_t + g_t * V'(t) - V(x_t))       g_t = gamma * (1 - terminated_t)
    v_s - V(x_s) = delta_s + g_s * c_s * (v_{s+1} - V(x_{s+1}))   (cut where an episode ends)
where V'(t) is the value of the state after step t (the final state for a truncated step).
The policy gradient uses  rho_t * (r_t + g_t * v'_{t+1} - V(x_t)) * grad log pi(a_t|x_t)  with
v'_{t+1} = v_{t+1} inside an episode and V'(t) where it ended (and at the segment's end).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.learner.losses.aggregate import Denominator, aggregate, categorical_entropy, masked_sum
from sluice.learner.losses.base import LossOutput


@dataclass
class VTraceTargets:
    vs: torch.Tensor  # [B, T] value targets
    pg_advantages: torch.Tensor  # [B, T] rho-weighted advantages for the policy gradient
    rhos: torch.Tensor  # [B, T] truncated importance weights (for metrics)


@torch.no_grad()
def vtrace_targets(
    target_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    rewards: torch.Tensor,
    values: torch.Tensor,
    next_values: torch.Tensor,
    terminated: torch.Tensor,
    ended: torch.Tensor,
    gamma: float,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
    lam: float = 1.0,
) -> VTraceTargets:
    """All [B, T], time last. See the module docstring for the definitions."""
    ratio = torch.exp(target_logprobs - behaviour_logprobs)
    rhos = ratio.clamp(max=rho_bar)
    cs = lam * ratio.clamp(max=c_bar)
    disc = gamma * (1.0 - terminated.to(values.dtype))
    cont = 1.0 - ended.to(values.dtype)
    deltas = rhos * (rewards + disc * next_values - values)
    corr = torch.zeros_like(values)  # v_s - V(x_s)
    running = torch.zeros_like(values[..., 0])
    for t in range(values.shape[-1] - 1, -1, -1):
        running = deltas[..., t] + disc[..., t] * cs[..., t] * cont[..., t] * running
        corr[..., t] = running
    vs = values + corr
    # v'_{t+1}: the target of the next state in the same episode, else the bootstrap value
    vs_next = next_values.clone()
    inside = cont[..., :-1].bool()
    vs_next[..., :-1] = torch.where(inside, vs[..., 1:], next_values[..., :-1])
    pg_adv = rhos * (rewards + disc * vs_next - values)
    return VTraceTargets(vs=vs, pg_advantages=pg_adv, rhos=rhos)


def vtrace_loss(
    logits: torch.Tensor,
    actions: torch.Tensor,
    values: torch.Tensor,
    targets: VTraceTargets,
    mask: torch.Tensor,
    denom: Denominator,
    rho_bar: float,
    value_coef: float,
    entropy_coef: float,
) -> LossOutput:
    """logits [B, T, A], actions [B, T], values [B, T] (with grad). Step-level means. Metrics
    (detached): policy_loss, value_loss, entropy, is_weight_mean and is_truncated_frac (of the
    truncated importance weights rho)."""
    logp = torch.log_softmax(logits, dim=-1).gather(-1, actions[..., None]).squeeze(-1)
    policy = aggregate(-targets.pg_advantages * logp, mask, "token", denom)
    value = 0.5 * aggregate((targets.vs - values) ** 2, mask, "token", denom)
    entropy = aggregate(categorical_entropy(logits), mask, "token", denom)
    loss = policy + value_coef * value - entropy_coef * entropy
    n = max(denom.tokens, 1.0)
    metrics = {
        "policy_loss": policy.detach(),
        "value_loss": value.detach(),
        "entropy": entropy.detach(),
        "is_weight_mean": masked_sum(targets.rhos, mask) / n,
        "is_truncated_frac": masked_sum((targets.rhos >= rho_bar).to(values.dtype), mask) / n,
    }
    return LossOutput(loss, metrics)
