"""Engines by name; heavy imports happen only for the engine asked for (a sim service never
imports torch)."""

from __future__ import annotations

import importlib.util

from rollout_svc.engines.base import Engine
from sluice.config.run import RunConfig

ENGINES = ("hf", "vllm", "sim", "auto")


def resolve_engine(kind: str) -> str:
    """`auto`: vllm where it is installed, else hf."""
    if kind != "auto":
        return kind
    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


def build_engine(cfg: RunConfig, seed: int) -> Engine:
    kind = resolve_engine(cfg.rollout.engine)
    if kind == "sim":
        from rollout_svc.engines.sim import SimEngine

        init = cfg.model.init
        if cfg.model.path is not None:
            raise ValueError("rollout.engine=sim builds its vocabulary from model.init; unset model.path")
        return SimEngine(init.tokens(), init.max_position_embeddings, cfg.rollout.sim, seed=seed)

    from sluice.modeling import materialize_model_dir

    model_dir = materialize_model_dir(cfg.model, cfg.run_dir)
    if kind == "hf":
        from rollout_svc.engines.hf import HFEngine

        return HFEngine(model_dir, dtype=cfg.model.dtype, device="cpu", seed=seed)
    if kind == "vllm":
        from rollout_svc.engines.vllm import VLLMEngine

        return VLLMEngine(model_dir, cfg.model.dtype, seed, cfg.rollout.vllm)
    raise ValueError(f"rollout.engine={kind!r}: expected one of {list(ENGINES)}")
