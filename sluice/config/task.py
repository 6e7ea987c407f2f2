"""The task a rollout service runs: its prompts and its rewards (docs/extending.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from sluice.config.base import Section
from sluice.plugins import PluginRef


class RewardFnConfig(Section):
    """One reward function of `task.rewards`."""

    fn: PluginRef
    """A built-in reward (`math`, `exact`), a name registered under the `sluice.rewards` entry
    points, or a reference: `package.module:fn`, `path/to/file.py:fn`. Called as
    `fn(prompt, completion, reference, **row) -> float | dict` (sync or `async def`)."""
    weight: float = 1.0
    """The sample's reward is the weighted sum of its functions' rewards."""
    name: str | None = None
    """Name in metrics (default: the function's own name)."""


class ScoringConfig(Section):
    """How rewards run: in a bounded pool, each call with a deadline, errors never silent."""

    workers: int = Field(default=4, ge=1)
    """Reward calls at once (threads for plain functions; concurrent tasks for `async def`)."""
    timeout_s: float = Field(default=30.0, gt=0)
    """Deadline of one call, from when it starts. A sync call past it is counted and its
    result ignored (Python cannot stop a thread: it keeps its worker until it returns); an
    async one is cancelled."""
    on_error: Literal["fail", "skip_group", "zero"] = "fail"
    """A call that raises or times out: fail (the service stops with the traceback in its log,
    and is not restarted: it would fail the same way), skip_group (the group is dropped and its
    admission quota given back), zero (the sample's reward is 0). Every one is counted and
    logged with its traceback."""


class EvalConfig(Section):
    """Held-out evaluation, run by rollout service 0 between its batches (evaluation.py)."""

    every: int = Field(default=0, ge=0)
    """Evaluate the weights of every k-th policy version (0: never)."""
    prompts: int = Field(default=32, ge=1)
    """Held-out prompts per evaluation (the task's `held_out` set, first ones)."""
    greedy: bool = True
    """Score one greedy completion per prompt (top_k=1)."""
    samples: int = Field(default=1, ge=0)
    """Sampled completions per prompt, under the run's sampling settings (0: none)."""


class OpponentPoolConfig(Section):
    """Earlier versions of a policy that a rollout service keeps to act as an opponent
    (self-play against the past: docs/multi_agent.md)."""

    every: int = Field(default=5, ge=1)
    """Keep the weights of every k-th version the service receives (version 0 always)."""
    size: int = Field(default=4, ge=1)
    """Versions kept; the oldest goes when a newer one comes."""
    latest: float = Field(default=0.0, ge=0.0, le=1.0)
    """Chance that a batch's opponent is the current version instead of one from the pool."""
    source: Literal["received", "checkpoints"] = "received"
    """received: copies of the versions the service receives over the weight channel, kept in
    its memory (a restarted service starts a new pool). checkpoints: the policy's checkpoints
    on disk (`checkpoints[-<policy>]/step_<v>`, plus the run's initial model as version 0), read
    when drawn: the pool outlives the service, and needs the run directory where the service
    runs (one host or a shared file system), `learner.checkpoint_every` > 0 and
    `learner.keep_checkpoints` >= `size`."""


class AgentConfig(Section):
    """One agent of a multi-agent task: the policy that acts for it."""

    policy: str
    """A policy id of learner.policies. Its learner group trains on this agent's turns, which
    go to that policy's stream in the buffer."""
    opponent_pool: OpponentPoolConfig | None = None
    """Act with an earlier version of `policy` from a pool the service keeps (self-play). Such
    an agent's turns are not trained: they were sampled by a version the learner left behind."""


class TaskConfig(Section):
    name: PluginRef = "copy"
    """A built-in task (copy, reverse, dataset, calculator; multi-agent: propose_solve, duel), a name
    registered under the `sluice.tasks` entry points, or a reference to a Task class:
    `package.module:Class`, `path/to/file.py:Class`."""
    params: dict[str, Any] = {}
    """Task-specific settings, validated by the task's own config model."""
    rewards: list[RewardFnConfig] = []
    """Reward functions scoring each completion instead of the task's own score (single-turn
    tasks). Empty: the task scores."""
    scoring: ScoringConfig = ScoringConfig()
    """How the task's score or the reward functions run."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation: greedy and sampled reward on prompts never trained on."""
    agents: dict[str, AgentConfig] = {}
    """A multi-agent task's agents (its `agents`, each named once) and the policy acting for
    each (docs/multi_agent.md). Empty: a single-agent task, served by one policy."""

    @field_validator("rewards")
    @classmethod
    def _unique_names(cls, rewards: list[RewardFnConfig]) -> list[RewardFnConfig]:
        names = [r.name for r in rewards if r.name is not None]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"reward names must be unique ({twice} given twice)")
        return rewards


def check_agents(task: TaskConfig, policies: list[str], rollout_kind: str) -> None:
    """Every agent acts for a policy the run trains, and every policy has a trained agent (a
    policy no agent trains would leave its learner group waiting for samples forever)."""
    agents = task.agents
    if not agents:
        if rollout_kind == "llm" and len(policies) > 1:
            raise ValueError(
                f"learner.policies={policies}: several policies with rollout.kind=llm need a "
                "multi-agent task (task.agents names the policy acting for each agent)"
            )
        return
    if rollout_kind != "llm":
        raise ValueError("task.agents: multi-agent tasks are LLM tasks (rollout.kind=llm)")
    if task.rewards or task.eval.every:
        raise ValueError(
            "task.agents: a multi-agent task's matches give the rewards (no task.rewards, task.eval)"
        )
    for name, agent in agents.items():
        if agent.policy not in policies:
            raise ValueError(
                f"task.agents.{name}.policy: {agent.policy!r} is not in learner.policies={policies}"
            )
    trained = {a.policy for a in agents.values() if a.opponent_pool is None}
    idle = [p for p in policies if p not in trained]
    if idle:
        raise ValueError(
            f"learner.policies: {idle} trained by no agent of task.agents (an agent with an "
            "opponent_pool acts but is not trained): its learner group would get no samples"
        )
