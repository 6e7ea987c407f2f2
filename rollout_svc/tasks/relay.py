"""A cooperative two-agent task for tiny models: a proposer passes a digit string to a solver.

The proposer sees the string (`3 1 =`) and writes a message; the solver sees only the message
(`<message> =`) and must write the string back. Both agents get the same reward, the copy
task's partial credit for the solver's answer (digits.py): a shared reward, so the proposer
is credited for a message the solver could read and the solver for reading it. Random tiny
policies score about 0.07; a pair that agreed on a code (copying is the easiest) scores 1.0.
"""

from __future__ import annotations

from sluice.rollout_svc.tasks.base import Prompt, Score
from sluice.rollout_svc.tasks.digits import DIGITS, DigitsConfig, copy_credit
from sluice.rollout_svc.tasks.multi_agent import Match, MultiAgentTask


class RelayMatch(Match):
    def __init__(self, secret: list[str]) -> None:
        self.secret = secret
        self.message = ""
        self.answer: tuple[str, bool] | None = None

    def observe(self, agent: str) -> str:
        if agent == "proposer":
            return " ".join(self.secret) + " ="
        return f"{self.message} =".lstrip()

    def act(self, agent: str, text: str, finished: bool) -> None:
        if agent == "proposer":
            self.message = text.strip()
        else:
            self.answer = (text, finished)

    def rewards(self) -> dict[str, Score]:
        assert self.answer is not None, "the solver has not acted"
        score = copy_credit(self.secret, *self.answer)
        return {"proposer": score, "solver": score}


class RelayTask(MultiAgentTask):
    name = "relay"
    Config = DigitsConfig
    config: DigitsConfig
    agents = ("proposer", "solver")

    def __init__(self, config: DigitsConfig, seed: int) -> None:
        super().__init__(config, seed)
        self._count = 0

    def sample(self, n: int) -> list[Prompt]:
        out = []
        for _ in range(n):
            self._count += 1
            secret = [self.rng.choice(DIGITS) for _ in range(self.config.length)]
            out.append(Prompt(f"r{self._count}", " ".join(secret), secret))
        return out

    def start(self, prompt: Prompt) -> RelayMatch:
        return RelayMatch(list(prompt.reference))

    def vocabulary(self) -> set[str]:
        return {*DIGITS, "="}
