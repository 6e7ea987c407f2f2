"""`sluice export`: a learner checkpoint to a plain Hugging Face model directory.

A checkpoint (`learner/checkpoint.py`) is a HF model directory plus training state
(`optimizer.pt`, `trainer_state.json`). The export loads it with transformers and saves only
the model (safetensors, config, generation config) and the tokenizer, optionally cast to
another dtype, so the result loads in transformers, vLLM or any HF tool and carries nothing
of the trainer. The output directory appears complete or not at all.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DTYPES = ("float32", "bfloat16")


class ExportError(ValueError):
    """The source is not a checkpoint, or the destination cannot be written."""


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, a run directory (its latest checkpoint), or a `checkpoints/`
    directory (its `latest`)."""
    p = Path(path)
    for candidate in (p, p / "latest", p / "checkpoints" / "latest"):
        if (candidate / "config.json").is_file():
            return candidate.resolve()
    raise ExportError(f"{str(p)!r} is not a checkpoint, a checkpoints/ directory or a run directory")


def export_checkpoint(
    src: str | Path, out: str | Path, dtype: str | None = None, overwrite: bool = False
) -> Path:
    ckpt = resolve_checkpoint(src)
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{str(out)!r} exists and is not empty (pass --overwrite to replace it)")
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r}: expected one of {sorted(DTYPES)}")
    from transformers import AutoModelForCausalLM, AutoTokenizer  # after the checks: slow to import

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype or "auto")
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
