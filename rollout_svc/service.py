"""The LLM rollout service: one batch is generated groups, scored, versions tagged.

`LLMProducer` samples prompts, generates `group_size` completions per prompt (single turn) or
episodes (multi turn), scores them, drops zero-variance groups if asked and builds the
trajectories; every token carries the version that sampled it and a trajectory's version is
the oldest of its model tokens. With `rollout.on_new_weights` continue/abort, weights also
change in the middle of a generation call (engines/base.py). Everything around a batch
(weights, admission, PUT, heartbeats) is the actor loop's (actor.py). A sim service imports no
torch: its "weights" are versions learned from the control plane.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge

from sluice.config.loader import ConfigError
from sluice.config.rollout import RolloutConfig, rollout_service_id
from sluice.config.run import RunConfig
from sluice.config.workflow_check import effective_workflow
from sluice.launch.threads import role_threads
from sluice.metrics import PrometheusEndpoint
from sluice.rollout_svc.actor import ActorLoop, OnePolicy, PollWeights, Produced, connect, run_actor
from sluice.rollout_svc.engines.base import Engine, SamplingParams
from sluice.rollout_svc.engines.registry import build_engine
from sluice.rollout_svc.episodes import GroupRequest, Sample, multi_turn, single_turn
from sluice.rollout_svc.evaluation import Evaluator
from sluice.rollout_svc.filters import ZeroVarianceFilter, build_filters, oversampler
from sluice.rollout_svc.scoring import ScoredBatch, Scorer
from sluice.rollout_svc.tasks.base import MultiTurnTask, Prompt, Task
from sluice.rollout_svc.tasks.registry import build_task
from sluice.rollout_svc.weights import VersionFeed, WeightFeed, receiver_feed
from sluice.trajectory import Trajectory

log = logging.getLogger(__name__)


@dataclass
class BatchStats:
    """What one LLM batch logs beside the loop's samples, pause_s and put_s."""

    tokens: int  # completion tokens of the samples PUT (model and environment)
    reward_mean: float  # over every generated sample (dropped groups included)
    generate_s: float
    score_s: float  # building trajectories (single-turn scoring happens inside generate_s)
    dropped_groups: int  # zero-variance groups dropped (DAPO filter)
    uniform_kept: int  # zero-variance groups kept anyway, after keep_after dropped in a row
    surplus_groups: int  # kept groups beyond the grant (oversampling for the filters), discarded
    skipped_groups: int  # groups a reward call failed in (task.scoring.on_error=skip_group)
    reward_errors: int  # reward calls that raised (skip_group / zero)
    reward_timeouts: int  # reward calls past task.scoring.timeout_s
    discarded_tokens: int  # tokens thrown away by abort-mode restarts
    truncated: int  # samples cut at their token budget
    version_spans: int  # samples whose tokens came from more than one version


class LLMProducer(OnePolicy):
    """Makes one batch: sample prompts, generate groups, score them, drop zero-variance groups
    if asked, and build trajectories. The actor loop (actor.py) does everything around it."""

    def __init__(self, cfg: RunConfig, index: int, registry: CollectorRegistry) -> None:
        self.cfg = cfg
        self.service_id = rollout_service_id(index)
        self.group_prefix = self.service_id  # the loop sets its incarnation's id
        self.policy_id = cfg.learner.policies[0]
        rc = cfg.rollout
        limit_engine_threads(cfg)
        self.engine: Engine = build_engine(cfg, rc.seed + 1000 * index)
        self.acting = self.engine
        self.task: Task = build_task(cfg.task, seed=cfg.run.seed * 7919 + index)
        self.scorer = Scorer(self.task, cfg.task)
        stages = effective_workflow(cfg).rollout
        self.filters = build_filters(stages, self.service_id)
        self.oversampler = oversampler(stages)
        self.tokenizer = self.engine.tokenizer
        if cfg.model.chat_template is not None:
            self.tokenizer.chat_template = cfg.model.chat_template  # type: ignore[attr-defined]
        check_vocabulary(self.task, self.tokenizer)
        self.sampling = sampling_params(rc)
        self.overlong_prompts = 0  # prompts skipped: no room left to answer
        self._init_metrics(registry)
        self.evaluator = (
            Evaluator(cfg, self.task, lambda p: prompt_token_ids(self.tokenizer, p), self.sampling, registry)
            if index == 0 and cfg.task.eval.every > 0
            else None
        )

    def request(self) -> dict[str, tuple[int, int]]:
        rc = self.cfg.rollout
        return {self.policy_id: (rc.prompts_per_batch * rc.group_size, rc.group_size)}

    def _init_metrics(self, reg: CollectorRegistry) -> None:
        self._c_tokens = Counter("sluice_rollout_tokens", "Completion tokens generated", registry=reg)
        self._g_reward = Gauge("sluice_rollout_reward_mean", "Mean reward of the last batch", registry=reg)
        self._c_gen_s = Counter("sluice_rollout_generate_seconds", "Time generating", registry=reg)
        self._c_dropped = Counter(
            "sluice_rollout_dropped_groups", "Zero-variance groups dropped (DAPO filter)", registry=reg
        )
        self._c_uniform_kept = Counter(
            "sluice_rollout_uniform_groups_kept",
            "Zero-variance groups kept after keep_after in a row were dropped (a solved task)",
            registry=reg,
        )
        self._c_surplus = Counter(
            "sluice_rollout_surplus_groups",
            "Kept groups beyond the grant, discarded (oversampling for the group filters)",
            registry=reg,
        )
        self._c_overlong = Counter(
            "sluice_rollout_overlong_prompts", "Prompts skipped: longer than the context", registry=reg
        )
        self._c_discarded = Counter(
            "sluice_rollout_discarded_tokens", "Tokens thrown away by abort-mode restarts", registry=reg
        )
        self._c_reward_failures = Counter(
            "sluice_rollout_reward_failures", "Reward calls that failed", ["kind"], registry=reg
        )
        self._c_skipped = Counter(
            "sluice_rollout_skipped_groups", "Groups dropped after a reward call failed", registry=reg
        )

    def produce(self, granted: Mapping[str, int], polls: Mapping[str, PollWeights]) -> Produced | None:
        rc = self.cfg.rollout
        if self.evaluator is not None and self.evaluator.due(self.engine.version):
            self.evaluator.run(self.engine.version, lambda req: self._rollout(req)[0])
        wanted = granted[self.policy_id] // rc.group_size
        prompts, prompt_ids = self.sample_prompts(self.oversampler.prompts(wanted))
        if not prompts:
            return None
        t0 = time.perf_counter()
        request = GroupRequest(
            prompts, prompt_ids, rc.group_size, self.sampling, polls[self.policy_id], rc.truncated_reward
        )
        groups, scored = self._rollout(request)
        t1 = time.perf_counter()
        live = [(p, ids, g) for p, ids, g in zip(prompts, prompt_ids, groups) if g]  # not skipped
        passed = self.uniform_kept()
        kept = [(p, ids, g) for p, ids, g in live if self.keep_group(g)]
        self.oversampler.observe(len(live), len(kept))
        trajs = [t for p, ids, g in kept[:wanted] for t in self.build_group(p, ids, g)]
        stats = batch_stats(
            groups,
            trajs,
            scored,
            dropped=len(live) - len(kept),
            uniform_kept=self.uniform_kept() - passed,
            surplus=max(0, len(kept) - wanted),
            generate_s=t1 - t0,
            score_s=time.perf_counter() - t1,
        )
        return self._report(trajs, stats, scored)

    def _rollout(self, request: GroupRequest) -> tuple[list[list[Sample]], ScoredBatch]:
        """Generate and score: single turn through the scorer, multi turn through episodes."""
        task = self.task
        if not task.multi_turn:
            return single_turn(self.engine, self.scorer, request)
        if isinstance(task, MultiTurnTask):
            return multi_turn(self.engine, task, request), ScoredBatch([])
        raise TypeError(f"task {task.name!r} says multi_turn but is not a MultiTurnTask")

    def _report(self, trajs: list[Trajectory], s: BatchStats, scored: ScoredBatch) -> Produced:
        self._c_tokens.inc(s.tokens)
        if s.reward_mean == s.reward_mean:  # not NaN: some group was scored
            self._g_reward.set(s.reward_mean)
        self._c_gen_s.inc(s.generate_s)
        self._c_dropped.inc(s.dropped_groups)
        self._c_uniform_kept.inc(s.uniform_kept)
        self._c_surplus.inc(s.surplus_groups)
        self._c_discarded.inc(s.discarded_tokens)
        self._c_reward_failures.labels("error").inc(s.reward_errors)
        self._c_reward_failures.labels("timeout").inc(s.reward_timeouts)
        self._c_skipped.inc(s.skipped_groups)
        components = {f"mean/{k}": float(np.mean(v)) for k, v in scored.components.items()}
        record = {**vars(s), "tokens_per_s": s.tokens / max(s.generate_s, 1e-9), **components}
        totals = {
            "generate_s": s.generate_s,
            "dropped_groups": float(s.dropped_groups),
            "uniform_kept": float(s.uniform_kept),
            "surplus_groups": float(s.surplus_groups),
            "skipped_groups": float(s.skipped_groups),
            "reward_failures": float(s.reward_errors + s.reward_timeouts),
        }
        return Produced(trajs, record, totals)

    def sample_prompts(self, n: int) -> tuple[list[Prompt], list[list[int]]]:
        """The task's next `n` prompts, tokenized, without those that leave the model no room
        to answer (counted and logged; their quota is refunded by the caller)."""
        prompts, ids = [], []
        for p in self.task.sample(n):
            tokens = prompt_token_ids(self.tokenizer, p)
            if len(tokens) >= self.engine.max_model_len:
                self.overlong_prompts += 1
                self._c_overlong.inc()
                log.warning("%s: prompt %s has %d tokens, max_model_len is %d: skipped",
                            self.service_id, p.prompt_id, len(tokens), self.engine.max_model_len)  # fmt: skip
                continue
            prompts.append(p)
            ids.append(tokens)
        return prompts, ids

    def uniform_kept(self) -> int:
        """Zero-variance groups the DAPO filter has kept so far (a solved task, filters.py)."""
        return sum(f.passed for f in self.filters if isinstance(f, ZeroVarianceFilter))

    def keep_group(self, group: list[Sample]) -> bool:
        """Whether every group filter of the workflow keeps the group (DAPO's and users')."""
        return all(keep(group) for keep in self.filters)

    def build_group(self, prompt: Prompt, prompt_ids: list[int], group: list[Sample]) -> list[Trajectory]:
        group_id = f"{self.group_prefix}/{prompt.prompt_id}"
        return [
            sample_trajectory(
                f"{group_id}/{j}", group_id, len(group), self.policy_id, prompt_ids, s, self.engine.version
            )
            for j, s in enumerate(group)
        ]

    def close(self) -> None:
        if self.evaluator is not None:
            self.evaluator.close()
        self.scorer.close()
        self.engine.close()


def limit_engine_threads(cfg: RunConfig) -> None:
    """The service's torch threads (rollout.torch_threads); a sim service imports no torch."""
    if cfg.rollout.engine != "sim":
        import torch

        torch.set_num_threads(role_threads(cfg.rollout.torch_threads))


def sampling_params(rc: RolloutConfig) -> SamplingParams:
    """One generation call's knobs, from `rollout.*`."""
    return SamplingParams(
        rc.max_new_tokens,
        rc.temperature,
        rc.on_new_weights,
        top_p=rc.top_p,
        top_k=rc.top_k,
        min_p=rc.min_p,
        stop=tuple(rc.stop),
        stop_token_ids=tuple(rc.stop_token_ids),
    )


def check_vocabulary(task: Task, tokenizer: Any) -> None:
    """Every token the task writes is in the model's tokenizer (a word-level one lacks most)."""
    unk = tokenizer.unk_token_id
    missing = {w for w in task.vocabulary() if unk in tokenizer.encode(w, add_special_tokens=False)}
    if missing:
        raise ValueError(
            f"task {task.name!r} writes tokens the model's tokenizer lacks: {sorted(missing)[:20]}"
        )


def prompt_token_ids(tok: Any, prompt: Prompt) -> list[int]:
    """The prompt's token ids, BOS first: its text, or its chat rendered by the tokenizer's
    chat template (with the generation prompt: the model answers as the assistant)."""
    if prompt.messages is None:
        return [tok.bos_token_id, *tok.encode(prompt.text, add_special_tokens=False)]
    if not getattr(tok, "chat_template", None) or not hasattr(tok, "apply_chat_template"):
        raise ConfigError(
            "config error: model.chat_template: the task's prompts are chats and the tokenizer "
            "has no chat template (set model.chat_template, or task.params.chat: off)"
        )
    text = tok.apply_chat_template(prompt.messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    return ids if ids[:1] == [tok.bos_token_id] else [tok.bos_token_id, *ids]


def sample_trajectory(
    traj_id: str,
    group_id: str,
    group_size: int,
    policy_id: str,
    prompt_ids: list[int],
    s: Sample,
    version: int,
) -> Trajectory:
    """One sample as a trajectory of `policy_id`; `version` tags a sample without tokens."""
    arrays = {
        "prompt_ids": np.asarray(prompt_ids, dtype=np.int32),
        "completion_ids": s.completion_ids.astype(np.int32),
        "behaviour_logprobs": s.logprobs.astype(np.float32),
        "token_versions": s.versions.astype(np.int32),
    }
    if s.loss_mask is not None:
        arrays["loss_mask"] = s.loss_mask.astype(np.uint8)
    return Trajectory(
        traj_id=traj_id,
        group_id=group_id,
        version=s.version if len(s.versions) else version,
        group_size=group_size,
        policy_id=policy_id,
        reward=s.reward,
        info={**s.info, "truncated": not s.finished},  # for the learner's overlong filter
        arrays=arrays,
    )


def batch_stats(
    groups: list[list[Sample]],
    trajs: list[Trajectory],
    scored: ScoredBatch,
    *,
    dropped: int,
    uniform_kept: int,
    surplus: int,
    generate_s: float,
    score_s: float,
) -> BatchStats:
    """A batch's figures; `dropped`: the groups the filters dropped, `uniform_kept`: the
    zero-variance groups DAPO's filter kept anyway (its `keep_after`), `surplus`: the kept
    groups beyond the grant (discarded)."""
    samples = [s for g in groups for s in g]
    return BatchStats(
        tokens=sum(len(t.arrays["completion_ids"]) for t in trajs),
        reward_mean=float(np.mean([s.reward for s in samples])) if samples else float("nan"),
        generate_s=generate_s,
        score_s=score_s,
        dropped_groups=dropped,
        uniform_kept=uniform_kept,
        surplus_groups=surplus,
        skipped_groups=scored.skipped_groups,
        reward_errors=scored.errors,
        reward_timeouts=scored.timeouts,
        discarded_tokens=sum(s.discarded_tokens for s in samples),
        truncated=sum(not s.finished for s in samples),
        version_spans=sum(len(np.unique(s.versions)) > 1 for s in samples),
    )


def weight_feed(cfg: RunConfig, service_id: str, zmq_ctx: zmq.Context | None) -> WeightFeed:
    """The one place that knows where an LLM service's weights come from."""
    return VersionFeed() if cfg.rollout.engine == "sim" else receiver_feed(cfg, service_id, zmq_ctx)


def build_actor(
    cfg: RunConfig,
    index: int,
    stop: threading.Event,
    *,
    prom: PrometheusEndpoint | None = None,
    zmq_ctx: zmq.Context | None = None,
) -> ActorLoop:
    """LLM rollout service `index`: its producer inside the actor loop. A pack of services in
    one process (pack.py) passes its shared metrics endpoint and ZeroMQ context."""
    if prom is None:
        prom = PrometheusEndpoint(cfg.metrics.prometheus_host, cfg.metrics.port("rollout", index))
    producer = LLMProducer(cfg, index, prom.registry)
    conn = connect(cfg, stop, prom, weight_feed, {producer.policy_id: cfg}, producer.service_id, zmq_ctx)
    # With no staleness slack, a sample begun on older weights is always dropped: wait for them.
    wait = cfg.rollout.wait_for_published_weights or cfg.learner.max_staleness == 0
    return ActorLoop(cfg, index, stop, producer, conn, wait_for_published=wait)


def run_rollout(cfg: RunConfig, index: int, stop: threading.Event) -> int:
    return run_actor(build_actor(cfg, index, stop))
