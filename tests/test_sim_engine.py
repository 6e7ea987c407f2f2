"""The sim engine: its latency model, its log-probs, and that a sim service imports no torch."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from sluice.config.model import VOCABULARIES
from sluice.config.rollout import SimEngineConfig
from sluice.modeling import build_tokenizer
from sluice.rollout_svc.engines.base import SamplingParams, WeightUpdate
from sluice.rollout_svc.engines.sim import SimEngine, WordTokenizer

TOKENS = VOCABULARIES["digits"]


def test_word_tokenizer_matches_the_models_tokenizer():
    ours, theirs = WordTokenizer(TOKENS), build_tokenizer(TOKENS)
    text = "3 1 4 = 9"
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    ids = [1, *ours.encode(text), 2]
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert (ours.bos_token_id, ours.eos_token_id, ours.unk_token_id) == (
        theirs.bos_token_id,
        theirs.eos_token_id,
        theirs.unk_token_id,
    )


def test_latency_model_and_logprobs():
    cfg = SimEngineConfig(
        call_s=0.01, prefill_s_per_token=0.001, decode_step_s=0.1, decode_s_per_seq=0.01, eos_prob=0.25
    )
    engine = SimEngine(TOKENS, 64, cfg, seed=0)
    slept = []
    engine.sleep = slept.append
    prompts = [[1, 5, 6, 14], [1, 7, 14]]
    groups = engine.generate(prompts, 3, SamplingParams(5, 1.0))
    lengths = [len(c.token_ids) for g in groups for c in g]
    # prefill: 3 copies of each prompt = 21 tokens; then one sleep per decode step for the live seqs
    assert slept[0] == pytest.approx(0.01 + 0.001 * 21)
    live_per_step = [sum(n > k for n in lengths) for k in range(max(lengths))]
    assert slept[1:] == pytest.approx([0.1 + 0.01 * live for live in live_per_step])
    eos_lp, word_lp = math.log(0.25), math.log(0.75 / len(TOKENS))
    for g in groups:
        for c in g:
            expected = np.where(c.token_ids == 2, eos_lp, word_lp)
            assert np.allclose(c.logprobs, expected)
            assert c.finished == (c.token_ids[-1] == 2)


def test_sim_takes_versions_mid_generation():
    engine = SimEngine(TOKENS, 64, SimEngineConfig(eos_prob=0.0), seed=1)
    engine.sleep = lambda s: None
    polls = iter([None, WeightUpdate(7, [])] + [None] * 100)
    (group,) = engine.generate(
        [[1, 5]], 2, SamplingParams(4, 1.0, on_new_weights="continue"), lambda: next(polls)
    )
    assert [c.versions.tolist() for c in group] == [[0, 0, 7, 7], [0, 0, 7, 7]]


def test_a_sim_service_process_never_imports_torch(tmp_path):
    code = (
        "import sys\n"
        "from sluice.config.run import RunConfig\n"
        "from sluice.rollout_svc.service import LLMProducer, build_actor\n"
        "from sluice.rollout_svc.engines.registry import build_engine\n"
        "cfg = RunConfig.model_validate({'run': {'dir': sys.argv[1]}, 'rollout': {'engine': 'sim'}})\n"
        "engine = build_engine(cfg, 0)\n"
        "from sluice.rollout_svc.engines.base import SamplingParams\n"
        "engine.generate([[1, 5, 14]], 2, SamplingParams(3, 1.0))\n"
        "import sluice.cli, sluice.launch.role\n"
        "sluice.launch.role.setup_logging('t')\n"
        "bad = [m for m in ('torch', 'transformers', 'vllm') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
