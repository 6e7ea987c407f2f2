"""The learner: optimisation, losses, learner groups (ranks, backend) and the staleness bound."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from sluice.config.base import Section
from sluice.config.loss import ClassicObjectiveConfig, GrpoLoss, LLMObjectiveConfig, LossConfig


class GroupPorts(Section):
    """Where one policy's learner group listens."""

    control: int = Field(default=0, ge=0, le=65535)
    """Control server port (admission, heartbeats) of this policy's rank 0."""
    weight_sync: int = Field(default=0, ge=0, le=65535)
    """Weight-sync TCPStore port of this policy's rank 0."""
    dist: int = Field(default=0, ge=0, le=65535)
    """torch.distributed rendezvous port of this policy's learner group."""
    host: str | None = None
    """Host of this policy's rank 0 (control server, weight-sync store, rendezvous). None: the
    first policy's (control.host, weight_sync.master_addr, learner.master_addr). The Ray
    launcher sets it: each group's rank 0 may sit on another node."""


class LearnerConfig(Section):
    total_steps: int = Field(default=300, ge=1)
    """Learner steps (= policy versions published) before the run ends. A step consumes one
    batch and makes `epochs * minibatches` optimizer updates."""
    batch_size: int = Field(default=128, ge=1)
    """Trajectories per learner step (whole groups: a multiple of rollout.group_size)."""
    lr: float = Field(default=5e-4, gt=0)
    """AdamW learning rate (peak, after warmup)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Decay of the learning rate over total_steps * epochs * minibatches updates."""
    warmup_steps: int = Field(default=0, ge=0)
    """Optimizer updates of linear warmup."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    adam_eps: float = Field(default=1e-8, gt=0)
    """AdamW epsilon."""
    grad_clip: float = Field(default=1.0, gt=0)
    """Global gradient-norm clip."""
    max_staleness: int = Field(default=2, ge=0)
    """The staleness bound: at learner version v no sample older than v - max_staleness is
    consumed. 0 is synchronous on-policy training; larger values let generation and training
    overlap more at the price of more off-policy correction."""
    loss: LossConfig = GrpoLoss()
    """The loss, by `type`: grpo, ppo, decoupled_ppo (LLM and classic RL but grpo), vtrace
    (classic RL), or a user's token loss by reference (sluice/config/loss.py); each type takes
    only its own knobs."""
    llm: LLMObjectiveConfig = LLMObjectiveConfig()
    """The LLM objective around the loss (rollout.kind llm): aggregation, group advantages, KL."""
    classic: ClassicObjectiveConfig = ClassicObjectiveConfig()
    """The classic-RL objective around the loss (rollout.kind env): discount, value, entropy, GAE."""
    epochs: int = Field(default=1, ge=1)
    """Passes over each batch (PPO epochs)."""
    minibatches: int = Field(default=1, ge=1)
    """Optimizer updates per pass; each rank splits its share into this many minibatches."""
    micro_batches: int = Field(default=1, ge=1)
    """Gradient accumulation: each minibatch is split into this many micro-batches (the same
    number on every rank), gradients summed, one optimizer update."""
    pack_sequences: bool = True
    """LLM policies: the policy's forward packs a batch's sequences into shared rows, each
    attending only within itself, instead of right-padding every row to the widest: fewer
    positions computed where lengths vary (learner/packing.py). Used where the model passes a
    check at start-up (its packed logits equal its padded ones); otherwise padded."""
    skip_zero_advantage: bool = True
    """LLM policies: rows whose advantage is exactly 0 (a group that scored alike) are left out
    of the forward and backward where the workflow's loss is a built-in policy loss alone, whose
    gradient there is exactly 0: the same update for less compute (docs/architecture.md, "Rows
    without gradient"). The loss's diagnostics are then means over the rows trained; the
    `inert_frac` metric is the share of tokens left out."""
    ranks: int = Field(default=1, ge=1)
    """Processes of each learner group (torch.distributed world size). The launcher starts them
    with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, as torchrun does."""
    backend: Literal["ddp", "deepspeed"] = "ddp"
    """ddp: torch DistributedDataParallel; deepspeed: DeepSpeed ZeRO (stage `zero_stage`)."""
    zero_stage: int = Field(default=2, ge=0, le=3)
    """DeepSpeed ZeRO stage: 1 partitions optimizer state, 2 also gradients, 3 also parameters."""
    dist_backend: Literal["auto", "gloo", "nccl", "hccl"] = "auto"
    """Collective backend of the learner group: auto = nccl on CUDA, hccl on Ascend, gloo on CPU."""
    master_addr: str = "127.0.0.1"
    """Rendezvous host of the learner group (rank 0)."""
    master_port: int = Field(default=0, ge=0, le=65535)
    """Rendezvous port of the learner group. 0: the local launcher picks a free port."""
    dist_timeout_s: float = Field(default=600.0, gt=0)
    """Collective timeout inside the learner group."""
    prefetch: bool = True
    """Rank 0 leases and prepares the next batch in a thread while the current step trains."""
    get_wait_ms: int = Field(default=200, ge=0)
    """How long one GET waits at the shard for data before returning empty."""
    checkpoint_every: int = Field(default=0, ge=0)
    """Save a checkpoint every k steps (0: only the final one). Leases of trained batches are
    ACKed once a checkpoint holding their effect is on disk (see learner/leases.py)."""
    max_restarts: int = Field(default=2, ge=0)
    """Times `sluice run` restarts a learner group that died (killed, crashed), from its latest
    checkpoint (learner.resume=auto), while the shards and rollout services go on. Needs
    checkpoint_every > 0; without a checkpoint a dead learner fails the run."""
    keep_checkpoints: int = Field(default=2, ge=1)
    """Checkpoints kept on disk (older ones are deleted)."""
    resume: str | None = None
    """Resume from a checkpoint: a path to a step_<v> directory, or 'auto' for
    <run dir>/checkpoints/latest when it exists (fresh start otherwise)."""
    target_return: float | None = None
    """Classic RL: stop when the mean return of the last `return_window` episodes reaches this."""
    return_window: int = Field(default=100, ge=1)
    """Episodes in the moving average of returns."""
    audit_consumed: bool = False
    """Append, per step, the traj_ids of its batch to metrics/consumed-<policy>.jsonl: trained,
    skipped (trained before) and dropped (beyond the bound, or of a lost lineage): an audit
    trail for exactly-once consumption, by id."""
    log_every: int = Field(default=1, ge=1)
    """Write a metrics line every k steps."""
    torch_threads: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    """intra-op (torch/OpenMP) threads of each learner process. auto: `sluice run` splits the
    host's cores between the roles (sluice/launch/threads.py: a CPU rollout service 1, the CPU
    learner the rest); a role started on its own takes OMP_NUM_THREADS, else its CPU affinity."""
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    """Where the learner trains: auto picks cuda, then npu, then cpu."""
    policies: list[str] = Field(default=["default"], min_length=1)
    """One learner group per policy id: its own buffer stream (GET policy_id), version counter,
    control server and weight channel. Rollout service i serves policies[i % len(policies)]."""
    group_ports: dict[str, GroupPorts] = {}
    """Ports of the groups of policies after the first (the first uses control.port,
    weight_sync.master_port and learner.master_port). The local launcher fills them."""

    @model_validator(mode="after")
    def _check(self) -> LearnerConfig:
        if len(set(self.policies)) != len(self.policies):
            raise ValueError(f"policies={self.policies}: policy ids must be unique")
        unknown = set(self.group_ports) - set(self.policies)
        if unknown:
            raise ValueError(f"group_ports: {sorted(unknown)} are not in policies")
        return self
