"""Every loss against a hand-computed example; V-trace also against a reference computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sluice.learner.losses.aggregate import Denominator, aggregate
from sluice.learner.losses.decoupled import behaviour_weights, decoupled_ppo_loss
from sluice.learner.losses.grpo import grpo_loss
from sluice.learner.losses.kl import kl_penalty
from sluice.learner.losses.ppo import clipped_surrogate, gae, value_loss
from sluice.learner.losses.vtrace import vtrace_loss, vtrace_targets

T = torch.tensor


def close(a, b, tol=1e-6):
    return math.isclose(
        float(torch.as_tensor(a).detach()), float(torch.as_tensor(b).detach()), rel_tol=tol, abs_tol=tol
    )


def test_token_and_sequence_aggregation_by_hand():
    values = T([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = T([[1, 1, 1], [1, 0, 0]])
    d = Denominator.of(mask)
    assert d == Denominator(tokens=4.0, sequences=2.0)
    assert close(aggregate(values, mask, "token", d), (1 + 2 + 3 + 4) / 4)  # 2.5
    assert close(aggregate(values, mask, "sequence", d), ((1 + 2 + 3) / 3 + 4 / 1) / 2)  # 3.0
    # split in two pieces with the global denominator: the pieces sum to the whole
    parts = [aggregate(values[i : i + 1], mask[i : i + 1], "sequence", d) for i in range(2)]
    assert close(sum(parts), 3.0)


def test_gae_by_hand():
    # one row, 4 steps; the episode terminates after step 1, a new one is truncated after step 3
    r = T([[1.0, 2.0, 0.5, 1.0]])
    v = T([[0.5, 1.0, 0.2, 0.4]])
    nv = T([[1.0, 9.0, 0.4, 0.7]])  # after step 1: ignored (terminal); after step 3: V(final obs)
    term = T([[0, 1, 0, 0]], dtype=torch.bool)
    ended = T([[0, 1, 0, 1]], dtype=torch.bool)
    g, lam = 0.9, 0.5
    d3 = 1.0 + g * 0.7 - 0.4  # truncated: bootstrap from V(final obs) = 0.7
    d2 = 0.5 + g * 0.4 - 0.2
    d1 = 2.0 + 0.0 - 1.0  # terminal: no bootstrap
    d0 = 1.0 + g * 1.0 - 0.5
    a3 = d3
    a2 = d2 + g * lam * a3
    a1 = d1  # the recursion stops at the episode end
    a0 = d0 + g * lam * a1
    adv, ret = gae(r, v, nv, term, ended, g, lam)
    assert torch.allclose(adv, T([[a0, a1, a2, a3]]))
    assert torch.allclose(ret, adv + v)


def test_clipped_surrogate_with_clip_higher_by_hand():
    # tokens: ratio 1.5 with A>0 (clipped at 1 + 0.28), ratio 0.5 with A>0 (not clipped: min
    # takes the unclipped), ratio 0.7 with A<0 (clipped at 1 - 0.2), one padding token
    old = T([[0.0, 0.0], [0.0, 0.0]])
    logp = torch.log(T([[1.5, 0.5], [0.7, 3.0]])).requires_grad_()
    adv = T([[2.0, 1.0], [-1.0, 5.0]])
    mask = T([[1, 1], [1, 0]])
    d = Denominator.of(mask)
    out = clipped_surrogate(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, mode="token", denom=d)
    per = [-min(1.5 * 2, 1.28 * 2), -min(0.5 * 1, 0.8 * 1), -min(0.7 * -1, 0.8 * -1)]
    assert close(out.loss, sum(per) / 3)
    assert close(out.metrics["clip_frac"], 2 / 3)  # tokens 0 and 2 took the clipped term
    assert close(out.metrics["ratio_mean"], (1.5 + 0.5 + 0.7) / 3)
    out.loss.backward()
    # clipped tokens get no gradient; the unclipped one gets -A * r / n (d r / d logp = r)
    assert torch.allclose(logp.grad, T([[0.0, -1.0 * 0.5 / 3], [0.0, 0.0]]), atol=1e-7)
    # symmetric clip: token 0 is clipped at 1.2 instead
    sym = clipped_surrogate(logp, old, adv, mask, 0.2, 0.2, "token", d)
    assert close(sym.loss, (-1.2 * 2 + per[1] + per[2]) / 3)


def test_decoupled_ppo_by_hand():
    behaviour = torch.log(T([[0.5, 0.2]]))
    proximal = torch.log(T([[0.6, 0.8]]))  # weights 1.2 and 4.0 -> capped at 2
    logp = torch.log(T([[0.66, 0.8]])).requires_grad_()  # ratios to proximal: 1.1 and 1.0
    adv = T([1.0])
    mask = T([[1, 1]])
    w, truncated = behaviour_weights(proximal, behaviour, is_cap=2.0)
    assert torch.allclose(w, T([[1.2, 2.0]])) and truncated.tolist() == [[False, True]]
    out = decoupled_ppo_loss(
        logp, proximal, behaviour, adv, mask, 0.2, 0.2, 2.0, "token", Denominator.of(mask)
    )
    assert close(out.loss, -(1.2 * 1.1 + 2.0 * 1.0) / 2, 1e-5)
    assert close(out.metrics["is_weight_mean"], 1.6) and close(out.metrics["is_weight_max"], 2.0)
    assert close(out.metrics["is_truncated_frac"], 0.5) and close(out.metrics["clip_frac"], 0.0)
    # without recomputation the proximal policy is mu: weights are 1 and it is PPO against mu
    plain = decoupled_ppo_loss(
        logp, behaviour, behaviour, adv, mask, 0.2, 0.2, 2.0, "token", Denominator.of(mask)
    )
    ppo = clipped_surrogate(logp, behaviour, adv, mask, 0.2, 0.2, "token", Denominator.of(mask))
    assert close(plain.loss, ppo.loss) and close(plain.metrics["is_weight_mean"], 1.0)
    assert close(plain.loss, -(1.2 * 1 + 1.2 * 1) / 2, 1e-5)  # ratios 1.32 and 4 clipped to 1.2


def test_value_loss_with_clipping_by_hand():
    v = T([[1.0, 3.0]])
    ret = T([[2.0, 0.0]])
    old = T([[0.0, 2.9]])
    mask = T([[1, 1]])
    d = Denominator.of(mask)
    assert close(value_loss(v, ret, mask, "token", d), 0.5 * (1 + 9) / 2)
    # step 0: clipped V = 0 + clamp(1, -.5, .5) = .5 -> (1.5)^2 = 2.25 > 1: take it
    # step 1: clipped V = 2.9 + .1 = 3.0 -> same 9
    assert close(value_loss(v, ret, mask, "token", d, old_values=old, clip=0.5), 0.5 * (2.25 + 9) / 2)


def test_kl_estimators_by_hand():
    logp = torch.log(T([[0.5, 0.25]]))
    ref = torch.log(T([[0.25, 0.25]]))
    mask = T([[1, 1]])
    d = Denominator.of(mask)
    k1 = kl_penalty(logp, ref, mask, "k1", "token", d)
    assert close(k1, (math.log(2) + 0) / 2)
    k3 = kl_penalty(logp, ref, mask, "k3", "token", d)
    assert close(k3, ((0.5 - math.log(0.5) - 1) + 0) / 2)  # ratio ref/pi = 0.5 and 1


def test_grpo_loss_with_global_denominator_sums_over_pieces():
    logp = T([[-1.0, -2.0], [-0.5, -0.1]])
    behaviour = T([[-1.0, -2.5], [-1.5, -0.1]])
    adv = T([1.0, -2.0])
    mask = T([[1, 1], [1, 0]])
    whole = grpo_loss(logp, behaviour, adv, mask, 2.0)
    d = Denominator.of(mask)
    pieces = [
        grpo_loss(logp[i : i + 1], behaviour[i : i + 1], adv[i : i + 1], mask[i : i + 1], 2.0, denom=d)
        for i in range(2)
    ]
    assert close(sum(p.loss for p in pieces), whole.loss)
    assert close(sum(p.metrics["is_truncated_frac"] for p in pieces), whole.metrics["is_truncated_frac"])


# ---------------------------------------------------------------------------------------------
# V-trace


def test_vtrace_by_hand():
    # one segment of 3 steps, no episode end; gamma 0.5, rho_bar = c_bar = 1
    ratios = [2.0, 0.5, 1.0]
    behaviour = T([[0.0, 0.0, 0.0]])
    target = torch.log(T([ratios]))
    r = T([[1.0, 0.0, 2.0]])
    v = T([[1.0, 2.0, 3.0]])
    nv = T([[2.0, 3.0, 4.0]])  # V(x_{t+1}); 4 is the bootstrap value
    no = torch.zeros(1, 3, dtype=torch.bool)
    out = vtrace_targets(target, behaviour, r, v, nv, no, no, gamma=0.5)
    rho = [1.0, 0.5, 1.0]
    c = [1.0, 0.5, 1.0]
    delta = [rho[0] * (1 + 0.5 * 2 - 1), rho[1] * (0 + 0.5 * 3 - 2), rho[2] * (2 + 0.5 * 4 - 3)]
    corr2 = delta[2]
    corr1 = delta[1] + 0.5 * c[1] * corr2
    corr0 = delta[0] + 0.5 * c[0] * corr1
    vs = [1 + corr0, 2 + corr1, 3 + corr2]
    assert torch.allclose(out.vs, T([vs]))
    pg = [rho[0] * (1 + 0.5 * vs[1] - 1), rho[1] * (0 + 0.5 * vs[2] - 2), rho[2] * (2 + 0.5 * 4 - 3)]
    assert torch.allclose(out.pg_advantages, T([pg]))


def reference_vtrace(log_rhos, discounts, rewards, values, bootstrap, rho_bar, c_bar):
    """The definition (Espeholt et al. 2018, eq. 1) as an explicit sum, one segment, numpy:
    v_s = V(x_s) + sum_{t>=s} (prod_{i<t, i>=s} gamma_i c_i) delta_t,
    and pg_adv_s = rho_s (r_s + gamma_s v_{s+1} - V(x_s)). Episode ends enter as gamma = 0."""
    n = len(rewards)
    rho = np.minimum(rho_bar, np.exp(log_rhos))
    c = np.minimum(c_bar, np.exp(log_rhos))
    v_next = np.append(values[1:], bootstrap)
    delta = rho * (rewards + discounts * v_next - values)
    vs = np.zeros(n)
    for s in range(n):
        total, weight = 0.0, 1.0
        for t in range(s, n):
            total += weight * delta[t]
            weight *= discounts[t] * c[t]
        vs[s] = values[s] + total
    vs_next = np.append(vs[1:], bootstrap)
    return vs, rho * (rewards + discounts * vs_next - values)


@pytest.mark.parametrize("seed", range(5))
def test_vtrace_matches_reference_computation(seed):
    g = np.random.default_rng(seed)
    n, gamma = 12, 0.97
    log_rhos = g.normal(0, 0.7, n)
    rewards = g.normal(0, 1, n)
    values = g.normal(0, 1, n)
    bootstrap = g.normal()
    terminated = g.random(n) < 0.15
    discounts = gamma * (1 - terminated)
    vs_ref, pg_ref = reference_vtrace(log_rhos, discounts, rewards, values, bootstrap, 1.0, 0.9)
    # ours: terminal steps are episode ends; next_values = V(x_{t+1}), bootstrap at the end
    nv = np.append(values[1:], bootstrap)
    out = vtrace_targets(
        torch.tensor(log_rhos)[None],
        torch.zeros(1, n, dtype=torch.float64),
        torch.tensor(rewards)[None],
        torch.tensor(values)[None],
        torch.tensor(nv)[None],
        torch.tensor(terminated)[None],
        torch.tensor(terminated)[None],
        gamma=gamma,
        rho_bar=1.0,
        c_bar=0.9,
    )
    np.testing.assert_allclose(out.vs[0].numpy(), vs_ref, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(out.pg_advantages[0].numpy(), pg_ref, rtol=1e-10, atol=1e-10)


def test_vtrace_on_policy_gives_bootstrapped_returns():
    """pi = mu, no clipping, lambda 1: v_s is the n-step discounted return plus the bootstrap."""
    r = T([[1.0, 2.0, 3.0]], dtype=torch.float64)
    v = T([[0.3, -0.2, 0.9]], dtype=torch.float64)
    nv = T([[-0.2, 0.9, 5.0]], dtype=torch.float64)
    zero = torch.zeros(1, 3, dtype=torch.float64)
    no = torch.zeros(1, 3, dtype=torch.bool)
    out = vtrace_targets(zero, zero, r, v, nv, no, no, gamma=0.9)
    returns = [1 + 0.9 * 2 + 0.81 * 3 + 0.729 * 5, 2 + 0.9 * 3 + 0.81 * 5, 3 + 0.9 * 5]
    assert torch.allclose(out.vs, T([returns], dtype=torch.float64))


def test_vtrace_truncation_bootstraps_from_the_final_state_and_cuts_the_trace():
    r = T([[1.0, 1.0]])
    v = T([[0.0, 0.0]])
    nv = T([[10.0, 3.0]])  # 10 = V(final obs) of the truncated episode, not V(x_1)
    term = torch.zeros(1, 2, dtype=torch.bool)
    ended = T([[1, 0]], dtype=torch.bool)
    out = vtrace_targets(torch.zeros(1, 2), torch.zeros(1, 2), r, v, nv, term, ended, gamma=0.5)
    assert torch.allclose(out.vs, T([[1 + 0.5 * 10, 1 + 0.5 * 3]]))  # no trace across the cut
    assert torch.allclose(out.pg_advantages, T([[6.0, 2.5]]))


def test_vtrace_loss_by_hand():
    logits = torch.zeros(1, 2, 2, requires_grad=True)  # uniform over 2 actions
    actions = T([[0, 1]])
    values = T([[0.5, 1.0]], requires_grad=True)
    targets = vtrace_targets(
        torch.log(T([[0.5, 0.5]])),
        torch.log(T([[0.5, 0.25]])),
        T([[1.0, 0.0]]),
        values.detach(),
        T([[1.0, 2.0]]),
        torch.zeros(1, 2, dtype=torch.bool),
        torch.zeros(1, 2, dtype=torch.bool),
        gamma=1.0,
    )
    mask = T([[1, 1]])
    out = vtrace_loss(logits, actions, values, targets, mask, Denominator.of(mask), 1.0, 0.5, 0.01)
    logp = math.log(0.5)
    pg = targets.pg_advantages[0]
    policy = -(pg[0] * logp + pg[1] * logp) / 2
    value = 0.5 * ((targets.vs[0, 0] - 0.5) ** 2 + (targets.vs[0, 1] - 1.0) ** 2) / 2
    ent = math.log(2)
    assert close(out.loss, policy + 0.5 * value - 0.01 * ent, 1e-5)
    assert close(out.metrics["is_weight_mean"], (1.0 + 1.0) / 2)  # ratios 1 and 2, capped at 1
    assert close(out.metrics["is_truncated_frac"], 1.0)
