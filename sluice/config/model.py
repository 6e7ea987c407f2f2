"""Which policy model to train and serve."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from sluice.config.base import Section

# Named vocabularies for locally built tokenizers. Every token a task writes must be here.
VOCABULARIES: dict[str, list[str]] = {
    "digits": [str(d) for d in range(10)] + ["="],
    "arith": [str(d) for d in range(10)]
    + ["=", "+", "-", "*", "(", ")", "?", ":", ","]
    + ["copy", "reverse", "sum", "answer", "user", "env", "assistant", "tool", "call", "result"],
}


class TinyModelInit(Section):
    """A small causal LM built from this config with random weights (nothing is downloaded)."""

    arch: Literal["llama"] = "llama"
    """Model family (transformers `LlamaForCausalLM`; vLLM serves it natively)."""
    vocab: str | list[str] = "digits"
    """A named vocabulary (see VOCABULARIES) or an explicit list of word-level tokens."""
    hidden_size: int = Field(default=64, ge=8)
    """Width of the residual stream."""
    intermediate_size: int = Field(default=128, ge=8)
    """Width of the MLP."""
    num_layers: int = Field(default=2, ge=1)
    """Transformer blocks."""
    num_heads: int = Field(default=2, ge=1)
    """Attention heads (key/value heads are the same number)."""
    head_dim: int = 32
    """Per-head width. vLLM's CPU attention supports 32, 64, 80, 96, 112, 128, 256."""
    max_position_embeddings: int = Field(default=64, ge=8)
    """Longest prompt + completion, in tokens."""
    seed: int = 0
    """Seed of the random initialisation (every role builds the same weights from it)."""

    @model_validator(mode="after")
    def _check_vocab(self) -> TinyModelInit:
        if isinstance(self.vocab, str) and self.vocab not in VOCABULARIES:
            raise ValueError(f"vocab={self.vocab!r} is not one of {sorted(VOCABULARIES)}")
        return self

    def tokens(self) -> list[str]:
        return list(VOCABULARIES[self.vocab]) if isinstance(self.vocab, str) else list(self.vocab)


class MLPModelInit(Section):
    """A small MLP policy with a value head, for classic RL (sluice/modeling/mlp.py). Its input
    and output sizes come from the environment's spaces."""

    hidden_sizes: list[int] = Field(default=[64, 64], min_length=1)
    """Widths of the shared torso layers."""
    activation: Literal["tanh", "relu"] = "tanh"
    """Nonlinearity between layers."""
    shared_torso: bool = False
    """True: policy and value heads on one torso. False: separate actor and critic torsos, so
    the value loss (returns of ~100) cannot swamp the policy's features; the classic choice."""
    seed: int = 0
    """Seed of the random initialisation (orthogonal, as in PPO reference implementations)."""


class ModelConfig(Section):
    kind: Literal["llm", "mlp"] = "llm"
    """llm: a causal language model (`path` or `init`); mlp: an MLP policy built from `mlp`."""
    mlp: MLPModelInit = MLPModelInit()
    """How to build the MLP policy when kind is mlp."""
    path: str | None = None
    """A Hugging Face model directory (config, safetensors, tokenizer). None: build `init` into
    `<run dir>/model` at start."""
    init: TinyModelInit = TinyModelInit()
    """How to build the model when `path` is None."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype on the learner; rollouts receive weights in this dtype."""
    chat_template: str | None = None
    """A Jinja chat template for chat prompts, in place of the tokenizer's own (a model built
    from `init`, or a local model directory without one). None: the tokenizer's."""
