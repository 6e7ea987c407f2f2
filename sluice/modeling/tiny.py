"""Build, save and load the policy model as a Hugging Face model directory.

Both the learner and the rollout services start from the same directory, so they agree on
architecture, tokenizer and initial weights; vLLM serves the same directory.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from sluice.config.model import ModelConfig, TinyModelInit
from sluice.modeling.tokenizer import build_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_tiny_model(init: TinyModelInit) -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase]:
    tokenizer = build_tokenizer(init.tokens())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=init.hidden_size,
        intermediate_size=init.intermediate_size,
        num_hidden_layers=init.num_layers,
        num_attention_heads=init.num_heads,
        num_key_value_heads=init.num_heads,
        head_dim=init.head_dim,
        max_position_embeddings=init.max_position_embeddings,
        pad_token_id=_token_id(tokenizer.pad_token_id, "pad"),
        bos_token_id=_token_id(tokenizer.bos_token_id, "bos"),
        eos_token_id=_token_id(tokenizer.eos_token_id, "eos"),
        tie_word_embeddings=False,
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(init.seed)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    return model, tokenizer


def _token_id(value: object, name: str) -> int:
    """A special token's id; transformers types them loosely (int, str or list)."""
    if not isinstance(value, int):
        raise TypeError(f"the built tokenizer's {name} token id is {value!r}, expected an int")
    return value


@contextmanager
def _one_builder(run_dir: Path) -> Iterator[None]:
    """One role builds the model directory while the others wait for it (a build costs ~0.7 s
    of CPU, most of it the imports `save_pretrained` brings in). The build's rename still keeps
    a half-written copy from being seen where the lock is not shared (a file system without
    flock: then every role builds, and one copy wins)."""
    with (run_dir / ".model.lock").open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:
            pass
        yield


def materialize_model_dir(cfg: ModelConfig, run_dir: Path) -> Path:
    """The model directory every role loads: `cfg.path`, or `<run_dir>/model` built from
    `cfg.init` (atomically, so concurrent roles starting at once agree on one copy)."""
    if cfg.path is not None:
        path = Path(cfg.path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path={str(path)!r} has no config.json")
        return path
    target = run_dir / "model"
    if (target / "config.json").is_file():
        return target
    run_dir.mkdir(parents=True, exist_ok=True)
    with _one_builder(run_dir):
        if (target / "config.json").is_file():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=".model-", dir=run_dir))
        model, tokenizer = build_tiny_model(cfg.init)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another role won the race; its copy is identical (same seed, same vocabulary).
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_policy(
    model_dir: Path, dtype: str = "float32", device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype])
    # transformers wraps PreTrainedModel.to with functools.wraps(nn.Module.to), so pyright sees the
    # unbound signature (device binds to self): a gap in transformers' typing, not a wrong call.
    return model.to(device), tokenizer  # pyright: ignore[reportArgumentType]
