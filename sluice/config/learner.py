"""The learner: optimisation, losses, learner groups (ranks, backend) and the staleness bound."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from sluice.config.base import Section


class LossConfig(Section):
    type: Literal["grpo", "ppo", "decoupled_ppo", "vtrace"] = "grpo"
    """grpo: group-normalised advantages, token-level policy gradient, truncated IS.
    ppo: clipped surrogate against the behaviour policy. decoupled_ppo: clipped surrogate
    against the proximal policy, behaviour correction by truncated IS weights (AReaL).
    vtrace: IMPALA actor-critic (classic RL only)."""
    is_cap: float = Field(default=2.0, gt=0)
    """Truncated importance sampling: behaviour weights pi / mu are capped at this value."""
    adv_eps: float = Field(default=1e-4, gt=0)
    """Added to the group reward std before dividing (group advantages)."""
    normalize_std: bool = True
    """Divide group-centred rewards by the group std (GRPO); False gives Dr.GRPO-style advantages."""
    clip_low: float = Field(default=0.2, ge=0, lt=1)
    """PPO ratio clip below: 1 - clip_low."""
    clip_high: float = Field(default=0.2, ge=0)
    """PPO ratio clip above: 1 + clip_high. DAPO's clip-higher sets it above clip_low (0.28)."""
    aggregation: Literal["token", "sequence"] = "token"
    """token: mean over all tokens/steps of the batch (DAPO's token-level loss); sequence:
    mean over sequences of each sequence's token mean (the original GRPO)."""
    recompute_proximal: bool = True
    """decoupled_ppo: compute the proximal policy's log-probs with the learner's weights before
    the batch's updates. False: the proximal policy is the behaviour policy (weights are 1)."""
    gamma: float = Field(default=1.0, ge=0, le=1)
    """Discount (GAE and V-trace)."""
    gae_lambda: float = Field(default=0.95, ge=0, le=1)
    """GAE lambda (ppo / decoupled_ppo with value-based advantages)."""
    value_coef: float = Field(default=0.5, ge=0)
    """Weight of the value loss (classic RL: ppo, decoupled_ppo, vtrace)."""
    value_clip: float | None = Field(default=None, gt=0)
    """PPO value clipping around the proximal values; None: no clipping."""
    entropy_coef: float = Field(default=0.0, ge=0)
    """Weight of the entropy bonus."""
    normalize_advantages: bool = False
    """Whiten advantages over the whole learner batch (all ranks) before the updates."""
    vtrace_rho_bar: float = Field(default=1.0, gt=0)
    """V-trace: cap of the importance weights in the value targets and the policy gradient."""
    vtrace_c_bar: float = Field(default=1.0, gt=0)
    """V-trace: cap of the trace-cutting coefficients c."""
    vtrace_lambda: float = Field(default=1.0, ge=0, le=1)
    """V-trace: lambda multiplying the trace coefficients."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the KL penalty to the reference model (the initial weights); 0: off (LLM only)."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """KL estimator per token: k1 = log pi - log ref; k3 = ref/pi - log(ref/pi) - 1 (>= 0)."""


class GroupPorts(Section):
    """Where one policy's learner group listens."""

    control: int = Field(default=0, ge=0, le=65535)
    """Control server port (admission, heartbeats) of this policy's rank 0."""
    weight_sync: int = Field(default=0, ge=0, le=65535)
    """Weight-sync TCPStore port of this policy's rank 0."""
    dist: int = Field(default=0, ge=0, le=65535)
    """torch.distributed rendezvous port of this policy's learner group."""


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
    loss: LossConfig = LossConfig()
    """The loss."""
    epochs: int = Field(default=1, ge=1)
    """Passes over each batch (PPO epochs)."""
    minibatches: int = Field(default=1, ge=1)
    """Optimizer updates per pass; each rank splits its share into this many minibatches."""
    micro_batches: int = Field(default=1, ge=1)
    """Gradient accumulation: each minibatch is split into this many micro-batches (the same
    number on every rank), gradients summed, one optimizer update."""
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
    """Append the traj_ids trained at every step to metrics/consumed-<policy>.jsonl (an audit
    trail for exactly-once consumption)."""
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
