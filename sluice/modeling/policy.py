"""The policy of a run, whatever its kind: build its directory once, load it anywhere.

`model.kind: llm` is a causal LM (sluice/modeling/tiny.py); `model.kind: mlp` is an MLP
policy whose sizes come from the gymnasium environment's spaces (sluice/modeling/mlp.py).
Both are model directories in the Hugging Face layout (config.json + model.safetensors), so
the learner, the rollouts and `export` treat them alike. Transformers is imported only for
LLM runs (it costs seconds of start-up per process).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from sluice.config.run import RunConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def env_spaces(env_id: str, kwargs: dict[str, Any]) -> tuple[int, int]:
    """(observation size, number of actions) of a gymnasium env with a flat Box observation
    space and a Discrete action space."""
    import gymnasium as gym

    from sluice.rollout_svc.envs.spec import env_spec

    env = gym.make(env_spec(env_id), **kwargs)
    try:
        obs, act = env.observation_space, env.action_space
        if not isinstance(act, gym.spaces.Discrete):
            raise ValueError(f"env.id={env_id!r}: action space {act} is not Discrete (MLP policies need it)")
        if not isinstance(obs, gym.spaces.Box) or len(obs.shape) != 1:
            raise ValueError(f"env.id={env_id!r}: observation space {obs} is not a flat Box")
        return int(obs.shape[0]), int(act.n)
    finally:
        env.close()


def materialize_policy_dir(cfg: RunConfig) -> Path:
    """The model directory every role of the run loads (built once, atomically)."""
    if cfg.model.kind == "llm":
        from sluice.modeling.tiny import materialize_model_dir  # transformers: LLM runs only

        path = materialize_model_dir(cfg.model, cfg.run_dir)
        if not (path / "config.json").is_file():
            raise RuntimeError(
                f"{path} has no config.json: was it built by a rank other than 0 of an initialised "
                "process group? (transformers then writes nothing)"
            )
        return path
    if cfg.model.path is not None:
        return Path(cfg.model.path)
    target = cfg.run_dir / "model"
    if (target / "config.json").is_file():
        return target
    from sluice.modeling.mlp import build_mlp_policy

    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    obs_dim, n_actions = env_spaces(cfg.env.id, cfg.env.kwargs)
    tmp = Path(tempfile.mkdtemp(prefix=".model-", dir=cfg.run_dir))
    build_mlp_policy(cfg.model.mlp, obs_dim, n_actions).save_pretrained(tmp)
    try:
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another role built the same one first
    return target


def load_policy_model(cfg: RunConfig, model_dir: Path, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer or None) for the run's model kind."""
    if cfg.model.kind == "llm":
        from sluice.modeling.tiny import load_policy

        return load_policy(model_dir, cfg.model.dtype, device)
    from sluice.modeling.mlp import load_mlp_policy

    return load_mlp_policy(model_dir, DTYPES[cfg.model.dtype], device), None
