"""The policy model every role loads: built locally, saved as a Hugging Face directory."""

from sluice.modeling.tiny import build_tiny_model, load_policy, materialize_model_dir
from sluice.modeling.tokenizer import build_tokenizer

__all__ = ["build_tiny_model", "build_tokenizer", "load_policy", "materialize_model_dir"]
