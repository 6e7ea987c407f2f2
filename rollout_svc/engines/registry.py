"""Engines by name; heavy imports happen only for the engine asked for."""

from __future__ import annotations

from pathlib import Path

from rollout_svc.engines.base import Engine


def build_engine(kind: str, model_dir: Path, dtype: str, seed: int) -> Engine:
    if kind == "hf":
        from rollout_svc.engines.hf import HFEngine

        return HFEngine(model_dir, dtype=dtype, device="cpu", seed=seed)
    raise ValueError(f"rollout.engine={kind!r}: expected one of ['hf']")
