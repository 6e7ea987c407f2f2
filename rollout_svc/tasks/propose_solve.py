"""A cooperative two-agent task for tiny models: a proposer writes a problem, a solver solves it.

The proposer is asked for a problem that starts with a given digit (`3 =`) and writes one:
`length` digits, the first of them that digit (`3 8`), then stop. The solver sees only the
problem (`3 8 =`) and must write it back (the copy task's partial credit, digits.py).

The team's reward is half the problem's credit (one point for the asked first digit, one for
a well-formed problem: `length` digits then stop, over two) and half the answer's, which counts
only on a valid problem (both points). Credit (`credit`): `split` (default) gives the proposer
the team reward and the solver its answer's credit on any well-formed problem, 0 on another
(nothing to solve); `shared` gives both the team reward. Both rules were measured: crediting
the solver's copies of malformed problems taught solvers never to stop (exact answers 0 in
1,500 steps), and counting the answer on problems with the wrong first digit let a proposer
settle on one problem its solver knew by heart (one seed in three). Random tiny policies score
about 0.05; a pair that learned both parts scores 1.0.
"""

from __future__ import annotations

from typing import Literal

from sluice.rollout_svc.tasks.base import Prompt, Score
from sluice.rollout_svc.tasks.digits import DIGITS, DigitsConfig, copy_credit
from sluice.rollout_svc.tasks.multi_agent import Match, MultiAgentTask


class ProposeSolveMatch(Match):
    def __init__(self, first: str, length: int, shared: bool) -> None:
        self.first, self.length, self.shared = first, length, shared
        self.problem: list[str] = []
        self.well_formed = False  # `length` digits, then stop
        self.problem_credit = 0.0
        self.answer: tuple[str, bool] | None = None

    def observe(self, agent: str) -> str:
        return f"{self.first} =" if agent == "proposer" else " ".join([*self.problem, "="])

    def act(self, agent: str, text: str, finished: bool) -> None:
        if agent == "proposer":
            self.problem = text.split()
            self.well_formed = (
                finished and len(self.problem) == self.length and set(self.problem) <= set(DIGITS)
            )
            self.problem_credit = (float(self.problem[:1] == [self.first]) + float(self.well_formed)) / 2
        else:
            self.answer = (text, finished)

    def rewards(self) -> dict[str, Score]:
        assert self.answer is not None, "the solver has not acted"
        solved = copy_credit(self.problem, *self.answer) if self.problem else Score(0.0, {"exact": 0.0})
        answer_credit = solved.reward if self.well_formed else 0.0  # nothing to solve otherwise
        valid = self.problem_credit == 1.0  # the asked first digit, `length` digits, stop
        team = (self.problem_credit + (answer_credit if valid else 0.0)) / 2
        info = {"valid": float(valid), "exact": solved.info["exact"], "team": team}
        solver = team if self.shared else answer_credit
        return {"proposer": Score(team, info), "solver": Score(solver, info)}


class ProposeSolveConfig(DigitsConfig):
    credit: Literal["shared", "split"] = "split"
    """shared: both agents get the team reward. split: the proposer gets the team reward, the
    solver its answer's credit alone (on a well-formed problem; 0 on any other), so the
    proposer's mistakes do not drown the solver's signal."""


class ProposeSolveTask(MultiAgentTask[ProposeSolveConfig]):
    name = "propose_solve"
    Config = ProposeSolveConfig
    agents = ("proposer", "solver")

    def sample(self, n: int) -> list[Prompt]:
        return [Prompt(self.prompt_id(), f"{d} =", d) for d in (self.rng.choice(DIGITS) for _ in range(n))]

    def start(self, prompt: Prompt) -> ProposeSolveMatch:
        return ProposeSolveMatch(prompt.reference, self.config.length, self.config.credit == "shared")

    def vocabulary(self) -> set[str]:
        return {*DIGITS, "="}
