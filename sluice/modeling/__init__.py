"""The policy model every role loads: built locally, saved as a Hugging Face directory.

Names are imported on first use (PEP 562), so `import sluice.modeling.mlp` or
`sluice.modeling.policy` does not pay for importing transformers.
"""

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what __getattr__ below imports on first use, for the type checker
    from sluice.modeling.tiny import build_tiny_model, load_policy, materialize_model_dir
    from sluice.modeling.tokenizer import build_tokenizer

_EXPORTS = {
    "build_tiny_model": "sluice.modeling.tiny",
    "load_policy": "sluice.modeling.tiny",
    "materialize_model_dir": "sluice.modeling.tiny",
    "build_tokenizer": "sluice.modeling.tokenizer",
}

__all__ = ["build_tiny_model", "load_policy", "materialize_model_dir", "build_tokenizer"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sluice.modeling' has no attribute {name!r}")
