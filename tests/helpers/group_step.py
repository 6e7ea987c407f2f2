"""One rank of a learner group taking two learner steps on fixed batches (for the DDP / ZeRO
equivalence tests). Run with torchrun's environment; writes the parameters and the step
statistics of rank 0 to OUT.

    RANK=r WORLD_SIZE=k MASTER_ADDR=... MASTER_PORT=... \
        python tests/helpers/group_step.py CONFIG OUT [--alike]

--alike: groups that score alike (zero advantages), which `learner.skip_zero_advantage` leaves
out of the step: in the first step every group a 2-rank split gives rank 0 (so one rank has
nothing left to compute while the other has), in the second every group.

(with tests/ on PYTHONPATH, as `helpers.procs.child_env` sets it)
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from helpers.groups import group_of
from sluice.config.loader import load_config
from sluice.learner.balance import assign_to_ranks
from sluice.learner.dist import init_dist
from sluice.learner.trainer import Trainer
from sluice.modeling.policy import materialize_policy_dir
from sluice.trajectory import Trajectory


def synthetic_batch(step: int, n_groups: int, group_size: int, vocab: int) -> list[Trajectory]:
    """Groups of LLM trajectories with different lengths and rewards (deterministic)."""
    g = np.random.default_rng(100 + step)
    out = []
    for k in range(n_groups):
        prompt = g.integers(3, vocab, size=int(g.integers(2, 6))).astype(np.int32)
        arrays = []
        for n in g.integers(1, 8, size=group_size):
            completion = g.integers(3, vocab, size=n).astype(np.int32)
            logprobs = (-g.random(n) * 3).astype(np.float32)
            arrays.append(
                {"prompt_ids": prompt, "completion_ids": completion, "behaviour_logprobs": logprobs}
            )
        out += group_of(f"{step}/{k}", arrays, rewards=g.random(group_size).tolist())
    return out


def scored_alike(batch: list[Trajectory], step: int, costs: list[int]) -> list[Trajectory]:
    """`batch` with the groups of `--alike` (above) all rewarded 0.5."""
    groups = [t.group_id for t in batch]
    first_half = {groups[i] for i in assign_to_ranks(costs, groups, 2)[0]}
    alike = set(groups) if step == 1 else first_half
    return [dataclasses.replace(t, reward=0.5) if t.group_id in alike else t for t in batch]


def main() -> None:
    cfg = load_config(sys.argv[1])
    out = Path(sys.argv[2])
    torch.manual_seed(0)
    model_dir = materialize_policy_dir(cfg)  # before the group exists (as the learner does)
    dist = init_dist(cfg.learner, torch.device("cpu"))
    trainer = Trainer(cfg, dist, model_dir)
    stats = []
    for step in range(2):
        batch = synthetic_batch(step, n_groups=4, group_size=4, vocab=10)
        costs = [trainer.objective.cost(t) for t in batch]
        if "--alike" in sys.argv[3:]:
            batch = scored_alike(batch, step, costs)
        shares = assign_to_ranks(costs, [t.group_id for t in batch], dist.world)
        stats.append(trainer.train_step([batch[i] for i in shares[dist.rank]]))
    with trainer.backend.full_params():
        params = {k: v.detach().clone().contiguous() for k, v in trainer.model.named_parameters()}
    if dist.is_main:
        save_file(params, str(out / "params.safetensors"))
        (out / "stats.json").write_text(json.dumps(stats))
    del trainer  # DDP's reducer must go before its process group (else exit can hang)
    dist.close()


if __name__ == "__main__":
    main()
