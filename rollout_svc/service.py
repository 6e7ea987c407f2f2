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
from dataclasses import dataclass

import numpy as np
import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge

from sluice.config.run import RunConfig
from sluice.launch.threads import role_threads
from sluice.metrics import PrometheusEndpoint
from sluice.rollout_svc.actor import ActorLoop, PollWeights, Produced, connect, run_actor
from sluice.rollout_svc.engines.base import Engine, SamplingParams, WeightUpdate
from sluice.rollout_svc.engines.registry import build_engine
from sluice.rollout_svc.episodes import GroupRequest, Sample, multi_turn, single_turn
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
    discarded_tokens: int  # tokens thrown away by abort-mode restarts
    truncated: int  # samples cut at their token budget
    version_spans: int  # samples whose tokens came from more than one version


class LLMProducer:
    """Makes one batch: sample prompts, generate groups, score them, drop zero-variance groups
    if asked, and build trajectories. The actor loop (actor.py) does everything around it."""

    def __init__(self, cfg: RunConfig, index: int, registry: CollectorRegistry) -> None:
        self.cfg = cfg
        self.service_id = f"rollout-{index}"
        self.group_prefix = self.service_id  # the loop sets its incarnation's id
        rc = cfg.rollout
        if rc.engine != "sim":
            import torch

            torch.set_num_threads(role_threads(rc.torch_threads))
        self.engine: Engine = build_engine(cfg, rc.seed + 1000 * index)
        self.task: Task = build_task(cfg.task, seed=cfg.run.seed * 7919 + index)
        self.tokenizer = self.engine.tokenizer
        self._check_vocabulary()
        self.sampling = SamplingParams(rc.max_new_tokens, rc.temperature, rc.on_new_weights)
        self.overlong_prompts = 0  # prompts skipped: no room left to answer
        self._init_metrics(registry)

    @property
    def version(self) -> int:
        return self.engine.version

    def load_weights(self, update: WeightUpdate) -> None:
        self.engine.load_weights(update.tensors, update.version)

    def request(self) -> tuple[int, int]:
        rc = self.cfg.rollout
        return rc.prompts_per_batch * rc.group_size, rc.group_size

    def _init_metrics(self, reg: CollectorRegistry) -> None:
        self._c_tokens = Counter("sluice_rollout_tokens", "Completion tokens generated", registry=reg)
        self._g_reward = Gauge("sluice_rollout_reward_mean", "Mean reward of the last batch", registry=reg)
        self._c_gen_s = Counter("sluice_rollout_generate_seconds", "Time generating", registry=reg)
        self._c_dropped = Counter(
            "sluice_rollout_dropped_groups", "Zero-variance groups dropped (DAPO filter)", registry=reg
        )
        self._c_overlong = Counter(
            "sluice_rollout_overlong_prompts", "Prompts skipped: longer than the context", registry=reg
        )
        self._c_discarded = Counter(
            "sluice_rollout_discarded_tokens", "Tokens thrown away by abort-mode restarts", registry=reg
        )

    def _check_vocabulary(self) -> None:
        unk = self.tokenizer.unk_token_id
        missing = {
            w for w in self.task.vocabulary() if unk in self.tokenizer.encode(w, add_special_tokens=False)
        }
        if missing:
            raise ValueError(
                f"task {self.task.name!r} writes tokens the model's tokenizer lacks: {sorted(missing)[:20]}"
            )

    def produce(self, granted: int, poll_weights: PollWeights) -> Produced | None:
        rc = self.cfg.rollout
        prompts, prompt_ids = self.sample_prompts(granted // rc.group_size)
        if not prompts:
            return None
        t0 = time.perf_counter()
        task = self.task
        request = GroupRequest(
            prompts, prompt_ids, rc.group_size, self.sampling, poll_weights, rc.truncated_reward
        )
        if not task.multi_turn:
            groups = single_turn(self.engine, task, request)
        elif isinstance(task, MultiTurnTask):
            groups = multi_turn(self.engine, task, request)
        else:
            raise TypeError(f"task {task.name!r} says multi_turn but is not a MultiTurnTask")
        t1 = time.perf_counter()
        kept = [(p, ids, g) for p, ids, g in zip(prompts, prompt_ids, groups) if self.keep_group(g)]
        trajs = [t for p, ids, g in kept for t in self.build_group(p, ids, g)]
        dropped = len(groups) - len(kept)
        stats = batch_stats(groups, trajs, dropped, generate_s=t1 - t0, score_s=time.perf_counter() - t1)
        return self._report(trajs, stats)

    def _report(self, trajs: list[Trajectory], s: BatchStats) -> Produced:
        self._c_tokens.inc(s.tokens)
        self._g_reward.set(s.reward_mean)
        self._c_gen_s.inc(s.generate_s)
        self._c_dropped.inc(s.dropped_groups)
        self._c_discarded.inc(s.discarded_tokens)
        record = {**vars(s), "tokens_per_s": s.tokens / max(s.generate_s, 1e-9)}
        totals = {"generate_s": s.generate_s, "dropped_groups": float(s.dropped_groups)}
        return Produced(trajs, record, totals)

    def sample_prompts(self, n: int) -> tuple[list[Prompt], list[list[int]]]:
        """The task's next `n` prompts, tokenized, without those that leave the model no room
        to answer (counted and logged; their quota is refunded by the caller)."""
        prompts, ids = [], []
        for p in self.task.sample(n):
            tokens = [self.tokenizer.bos_token_id, *self.tokenizer.encode(p.text, add_special_tokens=False)]
            if len(tokens) >= self.engine.max_model_len:
                self.overlong_prompts += 1
                self._c_overlong.inc()
                log.warning("%s: prompt %s has %d tokens, max_model_len is %d: skipped",
                            self.service_id, p.prompt_id, len(tokens), self.engine.max_model_len)  # fmt: skip
                continue
            prompts.append(p)
            ids.append(tokens)
        return prompts, ids

    def keep_group(self, group: list[Sample]) -> bool:
        """DAPO's filter: a group whose rewards are all equal has zero advantages."""
        if not self.cfg.rollout.drop_zero_variance_groups or len(group) < 2:
            return True
        rewards = [s.reward for s in group]
        return max(rewards) - min(rewards) > 1e-9

    def build_group(self, prompt: Prompt, prompt_ids: list[int], group: list[Sample]) -> list[Trajectory]:
        group_id = f"{self.group_prefix}/{prompt.prompt_id}"
        out = []
        for j, s in enumerate(group):
            arrays = {
                "prompt_ids": np.asarray(prompt_ids, dtype=np.int32),
                "completion_ids": s.completion_ids.astype(np.int32),
                "behaviour_logprobs": s.logprobs.astype(np.float32),
                "token_versions": s.versions.astype(np.int32),
            }
            if s.loss_mask is not None:
                arrays["loss_mask"] = s.loss_mask.astype(np.uint8)
            out.append(
                Trajectory(
                    traj_id=f"{group_id}/{j}",
                    group_id=group_id,
                    version=s.version if len(s.versions) else self.engine.version,
                    group_size=len(group),
                    reward=s.reward,
                    info=dict(s.info),
                    arrays=arrays,
                )
            )
        return out

    def close(self) -> None:
        self.engine.close()


def batch_stats(
    groups: list[list[Sample]], trajs: list[Trajectory], dropped: int, generate_s: float, score_s: float
) -> BatchStats:
    samples = [s for g in groups for s in g]
    return BatchStats(
        tokens=sum(len(t.arrays["completion_ids"]) for t in trajs),
        reward_mean=float(np.mean([s.reward for s in samples])),
        generate_s=generate_s,
        score_s=score_s,
        dropped_groups=dropped,
        discarded_tokens=sum(s.discarded_tokens for s in samples),
        truncated=sum(not s.finished for s in samples),
        version_spans=sum(len(np.unique(s.versions)) > 1 for s in samples),
    )


def weight_feed(cfg: RunConfig, service_id: str, zmq_ctx: zmq.Context | None) -> WeightFeed:
    """The one place that knows where an LLM service's weights come from."""
    return VersionFeed() if cfg.rollout.engine == "sim" else receiver_feed(cfg, service_id, zmq_ctx)


def build_actor(cfg: RunConfig, index: int, stop: threading.Event) -> ActorLoop:
    """LLM rollout service `index`: its producer inside the actor loop."""
    prom = PrometheusEndpoint(cfg.metrics.prometheus_host, cfg.metrics.port("rollout", index))
    producer = LLMProducer(cfg, index, prom.registry)
    conn = connect(cfg, stop, prom, lambda ctx: weight_feed(cfg, producer.service_id, ctx))
    # With no staleness slack, a sample begun on older weights is always dropped: wait for them.
    wait = cfg.rollout.wait_for_published_weights or cfg.learner.max_staleness == 0
    return ActorLoop(cfg, index, stop, producer, conn, wait_for_published=wait)


def run_rollout(cfg: RunConfig, index: int, stop: threading.Event) -> int:
    return run_actor(build_actor(cfg, index, stop))
