"""The hf engine's lean decoder reproduces the transformers forward: same logits at every step
for left-padded prompts of different lengths, grouped-query attention, tied embeddings, and
rope scaling; with one seed the engine samples the same tokens either way."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from sluice.rollout_svc.engines.base import SamplingParams
from sluice.rollout_svc.engines.hf import HFEngine, TransformersDecoder, build_decoder
from sluice.rollout_svc.engines.lean_llama import LeanLlamaDecoder, unsupported_reason


def llama(**overrides) -> LlamaForCausalLM:
    cfg = dict(
        vocab_size=24, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=8, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**(cfg | overrides))).eval()


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    lengths = [5, 2, 7, 7]
    ids = torch.zeros((4, 7), dtype=torch.long)
    valid = torch.zeros((4, 7), dtype=torch.bool)
    gen = torch.Generator().manual_seed(1)
    for i, n in enumerate(lengths):
        ids[i, 7 - n :] = torch.randint(1, 24, (n,), generator=gen)
        valid[i, 7 - n :] = True
    return ids, valid


MODELS = {
    "llama": lambda: llama(),
    "gqa": lambda: llama(num_key_value_heads=2),
    "tied": lambda: llama(tie_word_embeddings=True),
    "rope-scaled": lambda: llama(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen2-bias": lambda: _qwen2(),
}


def _qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=24, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    return Qwen2ForCausalLM(cfg).eval()


@pytest.mark.parametrize("name", sorted(MODELS))
@torch.no_grad()
def test_lean_logits_match_transformers(name):
    model = MODELS[name]()
    assert unsupported_reason(model) is None
    ids, valid = padded_batch()
    lean, ref = LeanLlamaDecoder(model), TransformersDecoder(model)
    a, b = lean.start(ids, valid, steps=6), ref.start(ids, valid, steps=6)
    rows = valid[:, -1]
    torch.testing.assert_close(a[rows], b[rows], atol=1e-5, rtol=1e-5)
    for _ in range(6):
        tok = b.argmax(-1)
        a, b = lean.step(tok), ref.step(tok)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_unsupported_models_fall_back_to_transformers():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=24)).eval()
    assert "gpt2" in unsupported_reason(gpt2)
    assert isinstance(build_decoder(gpt2, "auto"), TransformersDecoder)
    with pytest.raises(ValueError, match="rollout.hf_decoder=lean: model_type 'gpt2'"):
        build_decoder(gpt2, "lean")
    assert isinstance(build_decoder(llama(hidden_act="gelu"), "auto"), TransformersDecoder)
    assert isinstance(build_decoder(llama(), "auto"), LeanLlamaDecoder)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=10),
        SamplingParams(10, 0.8, top_p=0.9, top_k=5, min_p=0.05, stop=("3 4",), stop_token_ids=(9,)),
    ],
    ids=["plain", "filters-and-stops"],
)
def test_engine_samples_the_same_tokens_with_either_decoder(tmp_path, params):
    model = llama(vocab_size=24, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(tmp_path)
    from sluice.modeling.tokenizer import build_tokenizer

    build_tokenizer([str(d) for d in range(10)]).save_pretrained(tmp_path)
    prompts = [[1, 5, 6, 7], [1, 8], [1, 9, 10, 11, 12, 13]]
    runs = []
    for decoder in ("lean", "transformers"):
        engine = HFEngine(tmp_path, seed=3, decoder=decoder)
        runs.append(engine.generate(prompts, 4, params))
    for group_a, group_b in zip(*runs):
        for a, b in zip(group_a, group_b):
            assert a.token_ids.tolist() == b.token_ids.tolist()
            assert a.finished == b.finished
            torch.testing.assert_close(
                torch.from_numpy(a.logprobs), torch.from_numpy(b.logprobs), atol=1e-5, rtol=0
            )
