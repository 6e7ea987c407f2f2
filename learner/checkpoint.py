"""Checkpoints: weights as a Hugging Face directory (safetensors), plus trainer state.

Layout of `<run dir>/checkpoints/step_<version>/`:
    model.safetensors, config.json, tokenizer files   (loadable by transformers and vLLM)
    optimizer.pt                                       (torch.save of the optimizer state)
    trainer_state.json                                 (version, counters)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch


def save_checkpoint(
    run_dir: Path,
    version: int,
    model: torch.nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
) -> Path:
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{version:06d}"
    tmp = root / f".step_{version:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / "trainer_state.json").write_text(json.dumps({"version": version, **state}, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)  # a checkpoint directory is complete or absent
    latest = root / "latest"
    tmp_link = root / ".latest.tmp"
    tmp_link.unlink(missing_ok=True)
    tmp_link.symlink_to(final.name)
    os.replace(tmp_link, latest)
    return final
