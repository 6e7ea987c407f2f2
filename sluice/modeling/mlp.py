"""An MLP policy with a value head for classic RL, saved as a model directory.

The directory has the layout of a Hugging Face model directory: `config.json` (with
`model_type: sluice_mlp`) and `model.safetensors`, written and read with `safetensors` alone.
The class is a plain torch module on purpose: importing transformers' PreTrainedModel costs
seconds in every role, and nothing here needs it. Input and output sizes come from the
environment's spaces (discrete actions). Orthogonal initialisation as in PPO reference
implementations: gain sqrt(2) in the torsos, 0.01 on the policy head, 1 on the value head.
By default actor and critic have separate torsos (`shared_torso: false`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from sluice.config.model import MLPModelInit

MODEL_TYPE = "sluice_mlp"
ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU}


@dataclass
class MLPPolicyConfig:
    obs_dim: int
    n_actions: int
    hidden_sizes: list[int] = field(default_factory=lambda: [64, 64])
    activation: str = "tanh"
    shared_torso: bool = False


class MLPPolicy(nn.Module):
    """obs [..., obs_dim] -> (logits [..., n_actions], value [...])."""

    def __init__(self, config: MLPPolicyConfig) -> None:
        super().__init__()
        self.config = config
        self.torso = self._torso(config)
        self.value_torso = None if config.shared_torso else self._torso(config)
        width = config.hidden_sizes[-1]
        self.policy_head = nn.Linear(width, config.n_actions)
        self.value_head = nn.Linear(width, 1)

    @staticmethod
    def _torso(config: MLPPolicyConfig) -> nn.Sequential:
        layers: list[nn.Module] = []
        width = config.obs_dim
        for hidden in config.hidden_sizes:
            layers += [nn.Linear(width, hidden), ACTIVATIONS[config.activation]()]
            width = hidden
        return nn.Sequential(*layers)

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                gain = {id(self.policy_head): 0.01, id(self.value_head): 1.0}.get(id(module), math.sqrt(2.0))
                nn.init.orthogonal_(module.weight, gain)
                nn.init.zeros_(module.bias)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.torso(obs)
        value_hidden = hidden if self.value_torso is None else self.value_torso(obs)
        return self.policy_head(hidden), self.value_head(value_hidden).squeeze(-1)

    # -- the model directory -------------------------------------------------------------------

    def save_pretrained(self, directory: str | Path) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        config = {"model_type": MODEL_TYPE, "architectures": ["MLPPolicy"], **asdict(self.config)}
        (d / "config.json").write_text(json.dumps(config, indent=2))
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype = torch.float32) -> MLPPolicy:
        d = Path(directory)
        raw = json.loads((d / "config.json").read_text())
        if raw.get("model_type") != MODEL_TYPE:
            raise ValueError(f"{d}: model_type {raw.get('model_type')!r} is not {MODEL_TYPE!r}")
        fields_ = MLPPolicyConfig.__dataclass_fields__
        model = cls(MLPPolicyConfig(**{k: v for k, v in raw.items() if k in fields_}))
        model.load_state_dict(load_file(str(d / "model.safetensors")))
        return model.to(dtype)


def build_mlp_policy(init: MLPModelInit, obs_dim: int, n_actions: int) -> MLPPolicy:
    config = MLPPolicyConfig(obs_dim, n_actions, list(init.hidden_sizes), init.activation, init.shared_torso)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(init.seed)
        model = MLPPolicy(config)
        model.reset_parameters()
    finally:
        torch.random.set_rng_state(state)
    return model


def load_mlp_policy(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> MLPPolicy:
    return MLPPolicy.from_pretrained(model_dir, dtype=dtype).to(device)
