"""`sluice export`: a learner checkpoint to a plain Hugging Face model directory.

A checkpoint (`learner/checkpoint.py`) is a model directory (Hugging Face layout: config,
safetensors, tokenizer) plus training state (optimizer, scheduler, RNG, trainer state). The
export keeps only the model and tokenizer files, optionally cast to another dtype, so the
result loads in transformers, vLLM or any HF tool (an MLP policy with
`sluice.modeling.mlp.MLPPolicy.from_pretrained`) and carries nothing of the trainer. The
output directory appears complete or not at all.
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


# What a model directory is made of; everything else in a checkpoint (optimizer, scheduler,
# RNG, trainer state, ledger, DeepSpeed partitions) is training state and stays behind.
MODEL_FILES = ("config.json", "generation_config.json", "special_tokens_map.json", "chat_template.jinja")
MODEL_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "tokenizer*")


def model_files(ckpt: Path) -> list[Path]:
    files = {ckpt / name for name in MODEL_FILES if (ckpt / name).is_file()}
    for pattern in MODEL_PATTERNS:
        files |= {p for p in ckpt.glob(pattern) if p.is_file()}
    return sorted(files)


def export_checkpoint(
    src: str | Path, out: str | Path, dtype: str | None = None, overwrite: bool = False
) -> Path:
    """Write the model of a checkpoint as a plain model directory at `out`. Without `dtype`
    the files are copied as they are (bit-exact, any policy kind); with it, the model is loaded
    and saved cast to `dtype`."""
    ckpt = resolve_checkpoint(src)
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{str(out)!r} exists and is not empty (pass --overwrite to replace it)")
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r}: expected one of {sorted(DTYPES)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        if dtype is None:
            for f in model_files(ckpt):
                shutil.copy2(f, tmp / f.name)
        else:
            _save_cast(ckpt, tmp, dtype)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _save_cast(ckpt: Path, dest: Path, dtype: str) -> None:
    import json

    import torch

    if json.loads((ckpt / "config.json").read_text()).get("model_type") == "sluice_mlp":
        from sluice.modeling.mlp import MLPPolicy

        MLPPolicy.from_pretrained(ckpt, dtype=getattr(torch, dtype)).save_pretrained(dest)
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer  # after the checks: slow to import

    AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).save_pretrained(dest, safe_serialization=True)
    AutoTokenizer.from_pretrained(ckpt).save_pretrained(dest)
