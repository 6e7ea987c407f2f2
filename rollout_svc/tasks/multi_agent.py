"""The multi-agent task interface: several agents, each acting for its own policy, in one match.

A match is one episode between agents. The agents act in the order the task lists them, each
once: `observe(agent)` is the text that agent is prompted with (what the match lets it see, so
a later agent may see an earlier one's turn), the agent's policy completes it, `act` tells the
match what it wrote, and when every agent has acted `rewards` gives each agent its score:
the same for all (a shared, cooperative reward) or one per agent (separate rewards, as in a
zero-sum game). Which policy acts for which agent is the run's config (`task.agents`), not
the task's. docs/multi_agent.md tells the whole story (groups, credit assignment, self-play).
"""

from __future__ import annotations

import itertools
from abc import abstractmethod
from typing import Any, ClassVar

from sluice.rollout_svc.tasks.base import ConfigT, Prompt, Score, Task


class Match:
    """One episode of a multi-agent task; holds whatever state the task needs."""

    @abstractmethod
    def observe(self, agent: str) -> str:
        """The prompt text of `agent`'s turn."""

    @abstractmethod
    def act(self, agent: str, text: str, finished: bool) -> None:
        """`agent` wrote `text` (decoded; `finished` False when cut at its token budget)."""

    @abstractmethod
    def rewards(self) -> dict[str, Score]:
        """Every agent's score, once every agent has acted."""


class MultiAgentTask(Task[ConfigT]):
    agents: ClassVar[tuple[str, ...]]  # the agents of every match, in the order they act

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        agents = getattr(cls, "agents", ())
        if len(set(agents)) != len(agents):
            raise TypeError(f"{cls.__name__}.agents names an agent twice: {agents}")

    def __init__(self, config: ConfigT, seed: int) -> None:
        super().__init__(config, seed)
        self._prompts = itertools.count(1)

    def prompt_id(self) -> str:
        """A new prompt id (unique within the service, it becomes part of the group ids)."""
        return f"{self.name}{next(self._prompts)}"

    @abstractmethod
    def start(self, prompt: Prompt) -> Match:
        """A fresh match for one of `prompt`'s group of matches."""

    def score(self, prompt: Prompt, completion: str, finished: bool) -> Score:
        raise TypeError(f"{self.name} is multi-agent: its matches give the rewards")
