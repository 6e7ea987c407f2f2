"""The value model of an LLM workflow's critic (`critic_values`, `gae_advantages`, `value_loss`
stages; docs/workflows.md): a copy of the run's initial policy network whose last hidden state
feeds a scalar head, trained by the learner group beside the policy.

It is separate from the policy on purpose: the policy's parameters are exactly what the weight
broadcast sends and the rollout engines load, so a value head on the policy would have to be cut
out of every publish, checkpoint export and engine load. The critic has its own AdamW; its
gradients come from the same backward as the policy's (the value loss is one of the summed loss
terms, so they carry the backends' world-size scaling) and are averaged over the group's ranks
before its step, which gives the gradient of the global mean as the policy's backends do.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sluice.learner.batch import TokenBatch
from sluice.learner.dist import DistContext
from sluice.learner.packing import no_kv_cache

CRITIC_FILE = "critic.pt"


class Critic(torch.nn.Module):
    def __init__(
        self, model_dir: Path, dtype: str, device: torch.device, lr: float, grad_clip: float
    ) -> None:
        super().__init__()
        from sluice.modeling import load_policy

        policy, _ = load_policy(model_dir, dtype, device)
        self.backbone = policy.get_decoder()  # the transformer without its LM head
        hidden = int(policy.config.hidden_size)
        self.head = torch.nn.Linear(hidden, 1, device=device, dtype=next(policy.parameters()).dtype)
        torch.nn.init.zeros_(self.head.weight)  # V = 0 at the start: every rank begins equal
        torch.nn.init.zeros_(self.head.bias)
        self.grad_clip = grad_clip
        self.optimizer = torch.optim.AdamW(self.parameters(), lr=lr)

    def values(self, batch: TokenBatch) -> torch.Tensor:
        """V of the state before each target: [B, L-1] (position t sees tokens 0..t). On the
        batch's packed rows where it has them (learner/packing.py), gathered back to [B, L-1]."""
        packed, no_cache = batch.packed, no_kv_cache(self.backbone)
        if packed is None:
            out = self.backbone(input_ids=batch.input_ids, attention_mask=batch.attention_mask, **no_cache)
            return self.head(out.last_hidden_state[:, :-1]).squeeze(-1).float()
        out = self.backbone(input_ids=packed.input_ids, position_ids=packed.position_ids, **no_cache)
        return self.head(out.last_hidden_state.flatten(0, 1)[packed.index]).squeeze(-1).float()

    def step(self, dist: DistContext) -> float:
        """One update from the accumulated gradients: averaged over ranks, clipped. Returns the
        gradient norm before clipping."""
        params = [p for p in self.parameters() if p.grad is not None]
        if dist.distributed and params:
            flat = torch.cat([p.grad.reshape(-1) for p in params]).cpu()  # type: ignore[union-attr]
            flat = dist.all_reduce(flat) / dist.world
            offset = 0
            for p in params:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p))  # type: ignore[union-attr]
                offset += n
        norm = torch.nn.utils.clip_grad_norm_(self.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def save(self, directory: Path, dist: DistContext) -> None:
        if dist.is_main:  # replicated: one copy is every rank's
            torch.save(
                {"model": self.state_dict(), "optimizer": self.optimizer.state_dict()},
                directory / CRITIC_FILE,
            )

    def load(self, directory: Path) -> None:
        state = torch.load(directory / CRITIC_FILE, weights_only=True)
        self.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
