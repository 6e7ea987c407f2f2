"""The multi-agent LLM rollout service: one service hosts every policy of a multi-agent task.

`MultiAgentProducer` is the `Producer` (actor.py) of a run whose task is a `MultiAgentTask`:
it holds one engine per policy (and one more per agent that plays an opponent pool's past
versions), plays `group_size` matches per prompt, the agents acting in turn with their own
policy's engine, and turns each trained agent's turns into trajectories of that agent's
policy: its own groups, its own version tags, its own stream in the buffer. The actor loop
asks each policy's learner group for admission and takes each policy's weights from its own
channel, so every policy keeps its own version counter and staleness bound.
docs/multi_agent.md tells the whole story.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge

from sluice.config.errors import ConfigError
from sluice.config.policy import checkpoint_root, policy_view
from sluice.config.rollout import rollout_service_id
from sluice.config.run import RunConfig
from sluice.config.task import AgentConfig
from sluice.metrics import PrometheusEndpoint
from sluice.modeling.policy import materialize_policy_dir
from sluice.plugins import UserCodeError
from sluice.rollout_svc.actor import ActorLoop, PollWeights, Produced, connect, run_actor
from sluice.rollout_svc.engines.base import Completion, Engine, WeightUpdate
from sluice.rollout_svc.engines.registry import build_engine
from sluice.rollout_svc.episodes import to_sample
from sluice.rollout_svc.opponents import OpponentPool
from sluice.rollout_svc.service import (
    check_vocabulary,
    limit_engine_threads,
    prompt_token_ids,
    sample_trajectory,
    sampling_params,
    weight_feed,
)
from sluice.rollout_svc.tasks.base import Prompt, Score
from sluice.rollout_svc.tasks.multi_agent import Match, MultiAgentTask
from sluice.rollout_svc.tasks.registry import build_task
from sluice.trajectory import Trajectory

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Turn:
    """One agent's turn in one match."""

    prompt_ids: list[int]
    completion: Completion
    version: int  # of the weights that acted (a pool opponent's past version included)


class MultiAgentProducer:
    """Makes one batch of matches and the trajectories of every trained agent (module docstring)."""

    def __init__(self, cfg: RunConfig, index: int, registry: CollectorRegistry) -> None:
        self.cfg = cfg
        self.service_id = rollout_service_id(index)
        self.group_prefix = self.service_id  # the loop sets its incarnation's id
        task = build_task(cfg.task, seed=cfg.run.seed * 7919 + index)
        self.task = check_task_agents(task, cfg.task.agents)
        self.agents: dict[str, AgentConfig] = {a: cfg.task.agents[a] for a in self.task.agents}
        limit_engine_threads(cfg)
        seed = cfg.rollout.seed + 1000 * index
        self.engines: dict[str, Engine] = {
            p: build_engine(cfg, seed + k) for k, p in enumerate(cfg.learner.policies)
        }
        initial = materialize_policy_dir(cfg)
        self.pools = {
            agent: OpponentPool(
                a.opponent_pool,
                build_engine(cfg, seed + 100 + k),
                seed + 100 + k,
                checkpoints=(checkpoint_root(cfg, a.policy), initial),
            )
            for k, (agent, a) in enumerate(self.agents.items())
            if a.opponent_pool is not None
        }
        self.tokenizer = next(iter(self.engines.values())).tokenizer
        check_vocabulary(self.task, self.tokenizer)
        self.sampling = sampling_params(cfg.rollout)
        self._c_tokens = Counter("sluice_rollout_tokens", "Completion tokens generated", registry=registry)
        self._g_reward = Gauge(
            "sluice_rollout_reward_mean", "Mean reward of the last batch", ["agent"], registry=registry
        )

    def trained(self, policy: str) -> list[str]:
        """The agents whose turns train `policy` (not those playing its past versions)."""
        return [a for a, c in self.agents.items() if c.policy == policy and c.opponent_pool is None]

    def version_of(self, policy: str) -> int:
        return self.engines[policy].version

    def load_weights(self, policy: str, update: WeightUpdate) -> None:
        self.engines[policy].load_weights(update.tensors, update.version)
        self._offer(policy, update)

    def _offer(self, policy: str, update: WeightUpdate | None) -> WeightUpdate | None:
        """Every version of `policy` is offered to the pools of its past versions."""
        if update is not None:
            for agent, pool in self.pools.items():
                if self.agents[agent].policy == policy:
                    pool.offer(update)
        return update

    def request(self) -> dict[str, tuple[int, int]]:
        rc = self.cfg.rollout
        matches = rc.prompts_per_batch * rc.group_size
        return {p: (matches * len(self.trained(p)), rc.group_size) for p in self.engines if self.trained(p)}

    def produce(self, granted: Mapping[str, int], polls: Mapping[str, PollWeights]) -> Produced | None:
        rc = self.cfg.rollout
        per_prompt = {p: rc.group_size * len(self.trained(p)) for p in granted}
        n = min((granted[p] // per_prompt[p] for p in granted), default=rc.prompts_per_batch)
        if n == 0:
            return None
        prompts = self.task.sample(n)
        matches = [self.task.start(p) for p in prompts for _ in range(rc.group_size)]
        t0 = time.perf_counter()
        opponents = {agent: pool.draw() for agent, pool in self.pools.items()}
        turns = {agent: self._play(agent, matches, opponents.get(agent), polls) for agent in self.agents}
        generate_s = time.perf_counter() - t0
        rewards = [self._rewards(m) for m in matches]
        trajs = [
            t
            for agent in self.agents
            if agent not in self.pools
            for i, prompt in enumerate(prompts)
            for t in self._group(agent, prompt, turns[agent], rewards, i)
        ]
        return self._report(trajs, rewards, opponents, generate_s)

    def _play(
        self, agent: str, matches: list[Match], opponent: int | None, polls: Mapping[str, PollWeights]
    ) -> list[Turn]:
        """`agent`'s turn in every match, in one engine call: its policy's engine (taking new
        weights mid-batch if the run allows), or the pool's engine holding a past version."""
        policy = self.agents[agent].policy
        if opponent is not None:
            engine, interrupt = self.pools[agent].engine, None
        elif agent in self.pools:  # the pool drew the current version: it plays, untrained
            engine, interrupt = self.engines[policy], None
        else:
            engine, poll = self.engines[policy], polls.get(policy)
            interrupt = None if poll is None else lambda: self._offer(policy, poll())
        texts = [user_call(self.task.name, "observe", m.observe, agent) for m in matches]
        ids = [prompt_token_ids(self.tokenizer, Prompt("", text, None)) for text in texts]
        longest = max(ids, key=len)
        if len(longest) >= engine.max_model_len:
            raise ConfigError(
                f"config error: task {self.task.name!r}: {agent}'s prompt has {len(longest)} tokens, "
                f"no room to answer within the model's {engine.max_model_len} "
                "(model.init.max_position_embeddings)"
            )
        completions = engine.generate(ids, 1, self.sampling, interrupt)
        turns = []
        for m, prompt_ids, (c,) in zip(matches, ids, completions):
            text = self.tokenizer.decode(c.token_ids.tolist(), skip_special_tokens=True)
            user_call(self.task.name, "act", m.act, agent, text, c.finished)
            version = int(c.versions.min()) if len(c.versions) else engine.version
            turns.append(Turn(prompt_ids, c, version))
        return turns

    def _rewards(self, match: Match) -> dict[str, Score]:
        rewards = user_call(self.task.name, "rewards", match.rewards)
        missing = [a for a in self.agents if a not in rewards]
        if missing:
            raise UserCodeError(f"task {self.task.name!r}: the match's rewards() gave no score for {missing}")
        return rewards

    def _group(
        self, agent: str, prompt: Prompt, turns: list[Turn], rewards: list[dict[str, Score]], i: int
    ) -> list[Trajectory]:
        """The trajectories of `agent`'s turns in prompt i's matches: one group of its policy."""
        g = self.cfg.rollout.group_size
        group_id = f"{self.group_prefix}/{prompt.prompt_id}/{agent}"
        out = []
        for j in range(g):
            turn, score = turns[i * g + j], rewards[i * g + j][agent]
            sample = to_sample(turn.completion, score, self.cfg.rollout.truncated_reward)
            out.append(
                sample_trajectory(
                    f"{group_id}/{j}",
                    group_id,
                    g,
                    self.agents[agent].policy,
                    turn.prompt_ids,
                    sample,
                    turn.version,
                )
            )
        return out

    def _report(
        self,
        trajs: list[Trajectory],
        rewards: list[dict[str, Score]],
        opponents: dict[str, int | None],
        generate_s: float,
    ) -> Produced:
        tokens = sum(len(t.arrays["completion_ids"]) for t in trajs)
        self._c_tokens.inc(tokens)
        means = {a: float(np.mean([r[a].reward for r in rewards])) for a in self.agents}
        for agent, mean in means.items():
            self._g_reward.labels(agent).set(mean)
        trained = [means[a] for a in self.agents if a not in self.pools]
        infos: dict[str, dict[str, list[float]]] = {a: {} for a in self.agents}
        for r in rewards:
            for agent, score in r.items():
                for key, value in score.info.items():
                    if isinstance(value, int | float):
                        infos[agent].setdefault(key, []).append(float(value))
        record: dict[str, float | int | None] = {
            "matches": len(rewards),
            "tokens": tokens,
            "generate_s": generate_s,
            "tokens_per_s": tokens / max(generate_s, 1e-9),
            "reward_mean": float(np.mean(trained)),
            **{f"reward/{a}": m for a, m in means.items()},
            **{f"opponent_version/{a}": v for a, v in opponents.items()},  # None: the current version
            **{f"mean/{a}/{k}": float(np.mean(v)) for a, info in infos.items() for k, v in info.items()},
        }
        return Produced(trajs, record, {"generate_s": generate_s})

    def close(self) -> None:
        for engine in [*self.engines.values(), *(pool.engine for pool in self.pools.values())]:
            engine.close()


def check_task_agents(task: object, agents: Mapping[str, AgentConfig]) -> MultiAgentTask:
    """The task is multi-agent and `task.agents` names exactly its agents."""
    if not isinstance(task, MultiAgentTask):
        raise ConfigError(
            f"config error: task.agents: task {getattr(task, 'name', task)!r} is not a MultiAgentTask"
        )
    if set(agents) != set(task.agents):
        raise ConfigError(
            f"config error: task.agents: task {task.name!r} has agents {list(task.agents)}, "
            f"the config names {sorted(agents)}"
        )
    return task


def user_call(task: str, what: str, fn: Callable[..., T], *args: object) -> T:
    """A call into the task's match; what it raises stops the service as the user's error
    (a restart would raise the same)."""
    try:
        return fn(*args)
    except Exception as e:
        raise UserCodeError(f"task {task!r}: the match's {what}{args[:1]} raised {e!r}") from e


def build_multi_agent_actor(cfg: RunConfig, index: int, stop: threading.Event) -> ActorLoop:
    """Multi-agent rollout service `index`: every policy's engine, admission and weights."""
    prom = PrometheusEndpoint(cfg.metrics.prometheus_host, cfg.metrics.port("rollout", index))
    producer = MultiAgentProducer(cfg, index, prom.registry)
    views = {p: policy_view(cfg, p) for p in cfg.learner.policies}
    conn = connect(cfg, stop, prom, weight_feed, views, producer.service_id)
    wait = cfg.rollout.wait_for_published_weights or cfg.learner.max_staleness == 0
    return ActorLoop(cfg, index, stop, producer, conn, wait_for_published=wait)


def run_multi_agent_rollout(cfg: RunConfig, index: int, stop: threading.Event) -> int:
    return run_actor(build_multi_agent_actor(cfg, index, stop))
