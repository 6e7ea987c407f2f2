"""The shipped workflows the tests cover, and CartPole's config with a workflow in place of its
loss keys."""

from __future__ import annotations

from pathlib import Path

import yaml

from helpers.runs import ROOT

LLM_WORKFLOWS = ["grpo", "dapo", "dr_grpo", "rloo", "reinforce_pp", "gspo", "decoupled_ppo", "ppo_critic"]
ENV_WORKFLOWS = ["vtrace", "ppo_gae"]
CARTPOLE = ROOT / "configs" / "cartpole.yaml"


def cartpole_with(workflow: str, tmp_path: Path) -> Path:
    """configs/cartpole.yaml with its loss keys replaced by `workflow`."""
    tree = yaml.safe_load(CARTPOLE.read_text())
    for key in ("loss", "classic"):
        tree["learner"].pop(key)
    tree["workflow"] = workflow
    path = tmp_path / "cartpole.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path
