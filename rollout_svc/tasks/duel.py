"""A competitive two-player game for tiny models: each player plays one digit of its hand.

Both players are dealt a hand of digits (`4 9 2 =`) and play one of them at the same time
(neither sees the other's move). A legal play is exactly one digit of the player's own hand,
then stop. A legal play beats an illegal one, the higher of two legal plays wins, and a tie
(equal plays, or both illegal) is a draw: 1 for a win, 0 for a loss, 0.5 each for a draw, so
the rewards are separate and sum to 1. A random tiny policy rarely plays legally, so two of
them draw (about 0.5 each); a player that learned to play its highest digit beats them.
Self-play (`task.agents.second.opponent_pool`) trains one policy against its own past.
"""

from __future__ import annotations

from pydantic import Field

from sluice.config.base import Section
from sluice.rollout_svc.tasks.base import Prompt, Score
from sluice.rollout_svc.tasks.digits import DIGITS
from sluice.rollout_svc.tasks.multi_agent import Match, MultiAgentTask

PLAYERS = ("first", "second")


class DuelConfig(Section):
    hand: int = Field(default=3, ge=1, le=9)
    """Digits dealt to each player."""


class DuelMatch(Match):
    def __init__(self, hands: dict[str, list[str]]) -> None:
        self.hands = hands
        self.plays: dict[str, int | None] = {}

    def observe(self, agent: str) -> str:
        return " ".join(self.hands[agent]) + " ="

    def act(self, agent: str, text: str, finished: bool) -> None:
        words = text.split()
        legal = finished and len(words) == 1 and words[0] in self.hands[agent]
        self.plays[agent] = int(words[0]) if legal else None

    def rewards(self) -> dict[str, Score]:
        a, b = (self.plays[p] for p in PLAYERS)
        if a == b:
            first = 0.5
        elif a is None or b is None:
            first = float(b is None)
        else:
            first = float(a > b)
        return {
            p: Score(r, {"legal": float(self.plays[p] is not None)})
            for p, r in zip(PLAYERS, (first, 1.0 - first))
        }


class DuelTask(MultiAgentTask[DuelConfig]):
    name = "duel"
    Config = DuelConfig
    agents = PLAYERS

    def sample(self, n: int) -> list[Prompt]:
        out = []
        for _ in range(n):
            hands = {p: [self.rng.choice(DIGITS) for _ in range(self.config.hand)] for p in PLAYERS}
            text = " | ".join(" ".join(h) for h in hands.values())
            out.append(Prompt(self.prompt_id(), text, hands))
        return out

    def start(self, prompt: Prompt) -> DuelMatch:
        return DuelMatch(prompt.reference)

    def vocabulary(self) -> set[str]:
        return {*DIGITS, "="}
