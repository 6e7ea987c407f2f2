"""The sampling transform (sluice/modeling/sampling.py): each filter by hand, vLLM's order, the
hf engine's log-probs against the learner's under the filters, stop tokens and stop strings,
and a learner step on a token the current filters drop (finite loss, gradients and KL)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers.engines import max_logprob_error, stop_reasons, two_versions

from sluice.config import load_config
from sluice.config.loader import ConfigError
from sluice.config.model import ModelConfig
from sluice.learner.batch import collate, token_logprobs
from sluice.learner.dist import DistContext
from sluice.learner.losses.aggregate import Denominator
from sluice.modeling import load_policy, materialize_model_dir
from sluice.modeling.sampling import SamplingTransform, dropped, sampling_logprobs
from sluice.rollout_svc.engines.base import SamplingParams
from sluice.rollout_svc.engines.hf import HFEngine

INF = math.inf
# probabilities 0.5, 0.25, 0.15, 0.1 at temperature 1
LOGITS = torch.tensor([[0.5, 0.25, 0.15, 0.1]]).log()
# Measured on this machine, tiny model, float32, temperature 0.7, ~1100 tokens per setting: hf
# engine (lean decoder) vs learner at most 2.4e-7 with the initial weights and 3.6e-5 with the
# perturbed ones (1.4e-5 without filters): float noise between the two forwards' logits; the
# transform is the same function on both sides, and no token sat on a filter's boundary.
TOLERANCE = 1e-4
SETTINGS = {
    "top_p=0.9,top_k=5": dict(top_p=0.9, top_k=5),
    "min_p=0.1": dict(min_p=0.1),
    "top_k=5,top_p=0.9,min_p=0.05": dict(top_k=5, top_p=0.9, min_p=0.05),
}


@pytest.mark.parametrize(
    ("transform", "probs"),
    [
        (SamplingTransform(), [0.5, 0.25, 0.15, 0.1]),
        # temperature 2: p ~ sqrt(p) = .7071, .5, .3873, .3162 (sum 1.9106)
        (SamplingTransform(temperature=2.0), [0.3701, 0.2617, 0.2027, 0.1655]),
        # top_k 2: the two largest, renormalised: .5/.75, .25/.75
        (SamplingTransform(top_k=2), [2 / 3, 1 / 3, 0, 0]),
        # top_p 0.8: ascending cumsum .1, .25, .5, 1; drop where <= 0.2 (only .1): /0.9
        (SamplingTransform(top_p=0.8), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0]),
        # min_p 0.4: keep p >= 0.4 * 0.5 = 0.2
        (SamplingTransform(min_p=0.4), [2 / 3, 1 / 3, 0, 0]),
        # top_p after top_k, on its renormalised distribution: top_k 3 -> .5556, .2778, .1667;
        # cumsum .1667, .4444, 1; drop <= 0.45 -> only the first stays. (top_p 0.55 on the
        # unfiltered distribution would keep two: cumsum .1, .25, .5, 1.)
        (SamplingTransform(top_k=3, top_p=0.55), [1, 0, 0, 0]),
        # min_p after temperature: at T=2 the threshold is 0.6 * .3701 = .2221, keeping two
        # (.3701, .2617 -> .5858, .4142); on the untempered distribution only one would stay.
        (SamplingTransform(temperature=2.0, min_p=0.6), [0.5858, 0.4142, 0, 0]),
    ],
)
def test_transform_by_hand(transform, probs):
    logp = sampling_logprobs(LOGITS, transform)
    expected = torch.tensor([[math.log(p) if p else -INF for p in probs]])
    torch.testing.assert_close(logp, expected, atol=2e-4, rtol=0)


def test_keep_adds_the_target_to_the_kept_set():
    # top_k 1 keeps token 0 only; keeping token 2 too renormalises over {0, 2}: .5/.65, .15/.65
    logp = sampling_logprobs(LOGITS, SamplingTransform(top_k=1), keep=torch.tensor([2]))
    expected = torch.tensor([[math.log(0.5 / 0.65), -INF, math.log(0.15 / 0.65), -INF]])
    torch.testing.assert_close(logp, expected, atol=1e-5, rtol=0)
    # a target already kept changes nothing (the on-policy case)
    same = sampling_logprobs(LOGITS, SamplingTransform(top_k=2), keep=torch.tensor([1]))
    assert torch.equal(same, sampling_logprobs(LOGITS, SamplingTransform(top_k=2)))


@pytest.mark.vllm
def test_filters_drop_what_vllms_sampler_drops():
    """vLLM's own top-k/top-p op, and its min_p rule, on random logits: the same kept sets."""
    pytest.importorskip("vllm")
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn((256, 50), generator=gen) * 3
    for t in (SamplingTransform(0.7, 5, 0.9), SamplingTransform(0.7, 0, 0.8), SamplingTransform(1.3, 7, 1.0)):
        x = logits / t.temperature
        k = torch.full((len(x),), t.top_k or x.shape[1], dtype=torch.int32)
        theirs = apply_top_k_top_p(x.clone(), k if t.top_k else None, torch.full((len(x),), t.top_p))
        assert torch.equal(torch.isinf(theirs), dropped(x, t)), t
    t = SamplingTransform(0.7, min_p=0.2)
    x = logits / t.temperature
    p = x.softmax(-1)  # MinPLogitsProcessor.apply, line by line
    assert torch.equal(p < p.amax(-1, keepdim=True) * 0.2, dropped(x, t))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The default tiny model; the engine serves the sharper weights w1 as version 1."""
    model_dir = materialize_model_dir(ModelConfig(), tmp_path_factory.mktemp("model"))
    model, tok, w0, w1, prompts = two_versions(model_dir)
    engine = HFEngine(model_dir, seed=2)
    engine.load_weights(list(w1.items()), 1)
    return engine, model, tok, w1, prompts


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_hf_engine_logprobs_match_the_learner_under_the_filters(setup, name):
    engine, model, tok, w1, prompts = setup
    params = SamplingParams(12, 0.7, **SETTINGS[name])
    groups = engine.generate(prompts, 16, params)
    err = max_logprob_error(model, {1: w1}, prompts, groups, SamplingTransform.of(params), tok.pad_token_id)
    print(f"hf engine vs learner, temperature 0.7, {name}: max |diff| = {err:.2e}")
    assert err < TOLERANCE, err
    # the check can fail: the tempered distribution alone is not what was sampled from
    unfiltered = max_logprob_error(model, {1: w1}, prompts, groups, 0.7, tok.pad_token_id)
    assert unfiltered > 1e-2, unfiltered


def test_hf_engine_ends_at_stop_tokens_and_stop_strings(setup):
    engine, _, tok, _, prompts = setup
    # token 13 is "9"; the tiny tokenizer decodes "1 2" across two tokens
    params = SamplingParams(16, 1.0, stop=("7", "1 2"), stop_token_ids=(13,))
    reasons = stop_reasons(tok, engine.generate(prompts, 16, params), params)
    assert reasons["stop_string"] > 0 and reasons["stop_token"] > 0, reasons


def test_sim_engine_ends_at_stop_tokens_and_stop_strings():
    from sluice.config.rollout import SimEngineConfig
    from sluice.rollout_svc.engines.sim import SimEngine

    tokens = ModelConfig().init.tokens()
    engine = SimEngine(
        tokens, 64, SimEngineConfig(call_s=0, decode_step_s=0, decode_s_per_seq=0, eos_prob=0.05)
    )
    params = SamplingParams(16, 1.0, top_p=0.5, top_k=3, stop=("7", "1 2"), stop_token_ids=(13,))
    reasons = stop_reasons(engine.tokenizer, engine.generate([[1, 5, 14]], 32, params), params)
    assert reasons["stop_string"] > 0 and reasons["stop_token"] > 0, reasons


@pytest.mark.parametrize("workflow", ["grpo", "dapo", "decoupled_ppo", "gspo"])
def test_a_token_the_current_filters_drop_gives_finite_loss_and_gradients(tmp_path, workflow):
    """Off-policy: top_k=1 keeps only the current argmax, and the completions hold other
    tokens. Their exact filtered log-prob is -inf; the learner's (target kept) is finite, so
    are the loss, its statistics, the gradients and the proximal log-probs (decoupled PPO, GSPO)."""
    from sluice.learner.trainer import build_objective

    knobs = ["rollout.temperature=0.7", "rollout.top_k=1", f"workflow={workflow}"]
    cfg = load_config(None, [f"run.dir={tmp_path}", *knobs])
    model, tok, batch = _perturbed_policy_and_batch(tmp_path, cfg)
    exact = sampling_logprobs(_logits(model, batch), SamplingTransform.of(cfg.rollout))
    exact = exact.gather(-1, batch.targets[..., None]).squeeze(-1)
    assert torch.isinf(exact[batch.completion_mask]).sum() > 10  # the case is exercised
    obj = build_objective(cfg, model, tok, materialize_model_dir(cfg.model, tmp_path), torch.device("cpu"))
    piece = obj.prepare(model, _trajectories(), DistContext())
    proximal = piece.fields.get("proximal_logprobs")
    assert proximal is None or bool(torch.isfinite(proximal).all())
    value, stats = obj.loss(model, piece, Denominator(*obj.counts(piece)))
    value.backward()
    assert torch.isfinite(value) and all(torch.isfinite(v).all() for v in stats.values()), stats
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(bool(torch.isfinite(g).all()) for g in grads)
    assert any(bool(g.abs().sum() > 0) for g in grads)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_to_the_reference_under_the_filters_is_finite_and_zero_at_the_start(tmp_path, estimator):
    """The reference (initial weights) is computed like the policy: filtered, target kept
    (TokenObjective.prepare). Same weights: KL 0 exactly; after an update, with tokens outside
    both kept sets, finite with finite gradients. The exact filtered log-probs would make it
    NaN (what keeping the target avoids)."""
    from sluice.learner.batch import token_logprobs
    from sluice.learner.losses.kl import kl_penalty

    cfg = load_config(None, [f"run.dir={tmp_path}", "rollout.temperature=0.7", "rollout.top_k=1"])
    sampling = SamplingTransform.of(cfg.rollout)
    reference, _ = load_policy(materialize_model_dir(cfg.model, tmp_path))
    model, _, batch = _perturbed_policy_and_batch(tmp_path, cfg, scale=0.0)
    mask = batch.completion_mask
    denom = Denominator(float(mask.sum()), float(len(mask)))
    with torch.no_grad():
        ref = token_logprobs(reference, batch, sampling)
        same = kl_penalty(token_logprobs(model, batch, sampling), ref, mask, estimator, "token", denom)
    assert float(same) == 0
    model, _, batch = _perturbed_policy_and_batch(tmp_path, cfg)
    kl = kl_penalty(token_logprobs(model, batch, sampling), ref, mask, estimator, "token", denom)
    kl.backward()
    assert torch.isfinite(kl) and float(kl.detach()) != 0
    assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
    with torch.no_grad():
        exact = [sampling_logprobs(_logits(m, batch), sampling) for m in (model, reference)]
        exact = [e.gather(-1, batch.targets[..., None]).squeeze(-1) for e in exact]
        assert not torch.isfinite(kl_penalty(*exact, mask, estimator, "token", denom))


def _perturbed_policy_and_batch(tmp_path, cfg, scale: float = 0.05):
    """The run's initial policy, moved by `scale` * noise (an update later), and the batch."""
    model, tok = load_policy(materialize_model_dir(cfg.model, tmp_path))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return model, tok, collate(_trajectories(), tok.pad_token_id)


def _logits(model, batch) -> torch.Tensor:
    return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]


def _trajectories():
    from helpers.groups import group_of

    gen = np.random.default_rng(0)
    arrays = [
        {
            "prompt_ids": np.asarray([1, 5, 6, 14], dtype=np.int32),
            "completion_ids": gen.integers(4, 14, size=6).astype(np.int32),
            "behaviour_logprobs": np.full(6, -1.5, np.float32),
        }
        for _ in range(4)
    ]
    return group_of("g0", arrays) + group_of("g1", arrays[::-1])


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("rollout.top_p=0", "rollout.top_p"),
        ("rollout.top_p=1.5", "rollout.top_p"),
        ("rollout.top_k=-1", "rollout.top_k"),
        ("rollout.top_k=2.5", "rollout.top_k"),
        ("rollout.min_p=1", "rollout.min_p"),
        ("rollout.min_p=-0.1", "rollout.min_p"),
        ('rollout.stop=[""]', "rollout.stop.0"),
        ("rollout.stop=ab", "rollout.stop"),
        ("rollout.stop_token_ids=[-1]", "rollout.stop_token_ids.0"),
    ],
)
def test_bad_sampling_knobs_are_config_errors_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=rf"^config error: {key}: "):
        load_config(None, [override])


def test_sampling_knobs_reach_the_engines_and_the_learner(tmp_path):
    from prometheus_client import CollectorRegistry

    from sluice.learner.objectives.token import TokenObjective
    from sluice.learner.trainer import build_objective
    from sluice.rollout_svc.service import LLMProducer

    knobs = ["rollout.top_p=0.9", "rollout.top_k=5", "rollout.min_p=0.05", 'rollout.stop=["7"]']
    cfg = load_config(
        None, [f"run.dir={tmp_path}", "rollout.engine=sim", *knobs, "rollout.stop_token_ids=[13]"]
    )
    producer = LLMProducer(cfg, 0, CollectorRegistry())
    assert producer.sampling == SamplingParams(
        cfg.rollout.max_new_tokens,
        1.0,
        "finish",
        top_p=0.9,
        top_k=5,
        min_p=0.05,
        stop=("7",),
        stop_token_ids=(13,),
    )
    model_dir = materialize_model_dir(cfg.model, tmp_path)
    model, tok = load_policy(model_dir)
    objective = build_objective(cfg, model, tok, model_dir, torch.device("cpu"))
    assert isinstance(objective, TokenObjective) and objective.sampling == SamplingTransform(
        1.0, 5, 0.9, 0.05
    )


class _Recording(torch.nn.Module):
    """A stand-in LM that records the keyword arguments of each forward."""

    def __init__(self, config: SimpleNamespace | None) -> None:
        super().__init__()
        if config is not None:
            self.config = config
        self.head = torch.nn.Embedding(16, 16)
        self.calls: list[dict] = []

    def forward(self, input_ids, attention_mask, **kwargs):
        self.calls.append(kwargs)
        return SimpleNamespace(logits=self.head(input_ids))


class _Wrapper(torch.nn.Module):
    """Holds the model as `module` and delegates, as DDP and DeepSpeed's engine do."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


@pytest.mark.parametrize("has_switch", [True, False], ids=["transformers-config", "no-config"])
def test_the_learners_forward_builds_no_kv_cache_where_the_model_can_say_so(has_switch):
    model = _Recording(SimpleNamespace(use_cache=True) if has_switch else None)
    batch = collate(_trajectories(), pad_id=0)
    for m in (model, _Wrapper(model)):
        assert torch.isfinite(token_logprobs(m, batch, SamplingTransform())).all()
    assert model.calls == ([{"use_cache": False}] if has_switch else [{}]) * 2
