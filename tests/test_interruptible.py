"""Interruptible generation on the hf engine: version spans (continue), restarts (abort),
and behaviour log-probs that match the learner token by token, each under its own version."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.engines import max_logprob_error, poll_after, two_versions

from sluice.config.model import ModelConfig
from sluice.modeling import materialize_model_dir
from sluice.rollout_svc.engines.base import SamplingParams, WeightUpdate
from sluice.rollout_svc.engines.hf import HFEngine

TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_dir = materialize_model_dir(ModelConfig(), tmp_path_factory.mktemp("model"))
    return model_dir, *two_versions(model_dir)


def test_continue_records_version_spans_and_logprobs_per_span(setup):
    model_dir, model, tok, w0, w1, prompts = setup
    engine = HFEngine(model_dir, seed=1)
    params = SamplingParams(8, TEMPERATURE, on_new_weights="continue")
    groups = engine.generate(prompts, 8, params, poll_after(3, WeightUpdate(1, list(w1.items()))))
    assert engine.version == 1
    spans = 0
    for g in groups:
        for c in g:
            assert np.all(np.diff(c.versions) >= 0)  # versions never go back
            assert c.discarded_tokens == 0
            if len(c.token_ids) > 3:  # still running after 3 decode steps: switched there
                assert c.versions[:3].tolist() == [0, 0, 0] and set(c.versions[3:].tolist()) == {1}
                assert int(c.versions.min()) == 0  # the trajectory's version is its oldest span
                spans += 1
            else:
                assert set(c.versions.tolist()) == {0}
    assert spans > 0
    err = max_logprob_error(model, {0: w0, 1: w1}, prompts, groups, TEMPERATURE, tok.pad_token_id)
    assert err < 1e-4, err
    # the check can fail: pretending every token came from the old weights is far off
    wrong = max_logprob_error(model, {0: w0}, prompts, _relabel(groups, 0), TEMPERATURE, tok.pad_token_id)
    assert wrong > 1e-2, wrong


def _relabel(groups, version):
    from dataclasses import replace

    return [[replace(c, versions=np.full_like(c.versions, version)) for c in g] for g in groups]


def test_abort_restarts_in_flight_sequences_on_new_weights(setup):
    model_dir, model, tok, w0, w1, prompts = setup
    engine = HFEngine(model_dir, seed=2)
    params = SamplingParams(8, TEMPERATURE, on_new_weights="abort")
    groups = engine.generate(prompts, 8, params, poll_after(2, WeightUpdate(1, list(w1.items()))))
    restarted = 0
    for g in groups:
        for c in g:
            versions = set(c.versions.tolist())
            if c.discarded_tokens:  # was in flight at the update: dropped 2 tokens, began again
                assert c.discarded_tokens == 2 and versions == {1}
                restarted += 1
            else:  # ended (end-of-sequence) within the first 2 steps, on the old weights
                assert versions == {0} and c.finished and len(c.token_ids) <= 2
    assert restarted > 0
    err = max_logprob_error(model, {0: w0, 1: w1}, prompts, groups, TEMPERATURE, tok.pad_token_id)
    assert err < 1e-4, err


def test_finish_mode_takes_weights_only_between_calls(setup):
    model_dir, _, _, _, w1, prompts = setup
    engine = HFEngine(model_dir, seed=3)

    def poll():
        raise AssertionError("finish mode must not poll for weights mid-generation")

    groups = engine.generate(prompts, 4, SamplingParams(6, TEMPERATURE), poll)
    assert all(set(c.versions.tolist()) == {0} for g in groups for c in g)
    engine.load_weights(list(w1.items()), 5)
    groups = engine.generate(prompts, 4, SamplingParams(6, TEMPERATURE), poll)
    assert all(set(c.versions.tolist()) == {5} for g in groups for c in g)


def test_completion_budget_fits_the_context(setup):
    model_dir, _, tok, _, _, _ = setup
    engine = HFEngine(model_dir, seed=4)  # max_position_embeddings 64
    long_prompt = [tok.bos_token_id] + [5] * 59  # 60 tokens: room for 4
    (group,) = engine.generate([long_prompt], 4, SamplingParams(8, 1.0))
    assert all(len(c.token_ids) <= 4 for c in group)
    assert any(not c.finished for c in group) or all(len(c.token_ids) <= 4 for c in group)
    with pytest.raises(ValueError, match="no room"):
        engine.generate([[tok.bos_token_id] + [5] * 63], 1, SamplingParams(8, 1.0))
