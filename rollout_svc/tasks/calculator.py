"""A multi-turn, tool-call style task: arithmetic with a calculator tool.

Prompt: `user 3 + 4 * 2 ? assistant`. Each model turn (ended by end-of-sequence) is either

- a tool call `call <expression>`: the environment evaluates it and replies
  `tool result <value> assistant`, and the model continues;
- a final answer `answer <value>`: the episode ends with reward 1 if the value is right,
  `format_reward` if it is a well-formed number but wrong;
- anything else: the episode ends with reward 0.

An episode without an answer after `max_turns` model turns (or out of context) scores 0.
Numbers are written digit by digit (`1 2` is twelve), so the task fits the word-level `arith`
vocabulary of the tiny models.
"""

from __future__ import annotations

import ast
import operator
import random
import re

from pydantic import Field

from sluice.config.base import Section
from sluice.rollout_svc.tasks.base import EnvReply, Episode, MultiTurnTask, Prompt

DIGITS = [str(d) for d in range(10)]
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_INTEGER = re.compile(r"-?\d+")


class CalculatorConfig(Section):
    operands: int = Field(default=2, ge=2, le=6)
    """Single-digit operands per question."""
    operators: str = Field(default="+-*", pattern=r"^[+\-*]+$")
    """Operators questions use (any of + - *)."""
    max_turns: int = Field(default=3, ge=1, le=16)
    """Model turns per episode at most."""
    format_reward: float = Field(default=0.1, ge=0, le=1)
    """Reward of a well-formed but wrong answer."""


def evaluate(expression: str) -> int:
    """Value of an integer expression of + - * and parentheses; ValueError otherwise. Walks
    the syntax tree itself: model output is never handed to eval."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if abs(left) > 10**12 or abs(right) > 10**12:
                raise ValueError("operand too large")
            return _BINARY[type(node.op)](left, right)
        raise ValueError(f"not allowed in a calculator expression: {type(node).__name__}")

    if not expression or len(expression) > 200:
        raise ValueError("empty or too long")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as e:
        raise ValueError(str(e)) from None
    return walk(tree)


def spell(value: int) -> str:
    """12 -> '1 2', -3 -> '- 3' (digit-level words)."""
    return " ".join(str(value))


class CalculatorEpisode(Episode):
    def __init__(self, answer: int, format_reward: float) -> None:
        self.answer = answer
        self.format_reward = format_reward
        self.calls = 0

    def respond(self, model_text: str, finished: bool) -> EnvReply:
        words = model_text.split()
        if not finished or not words:
            return EnvReply(None, 0.0, {"calls": self.calls, "correct": 0.0})
        head, rest = words[0], "".join(words[1:])
        if head == "call":
            self.calls += 1
            try:
                value = evaluate(rest)
            except ValueError:
                return EnvReply("tool result ? assistant")
            return EnvReply(f"tool result {spell(value)} assistant")
        if head == "answer" and _INTEGER.fullmatch(rest):
            correct = int(rest) == self.answer
            reward = 1.0 if correct else self.format_reward
            return EnvReply(None, reward, {"calls": self.calls, "correct": float(correct)})
        return EnvReply(None, 0.0, {"calls": self.calls, "correct": 0.0})

    def cut_short(self) -> EnvReply:
        return EnvReply(None, 0.0, {"calls": self.calls, "correct": 0.0})


class CalculatorTask(MultiTurnTask[CalculatorConfig]):
    name = "calculator"
    Config = CalculatorConfig

    def __init__(self, config: CalculatorConfig, seed: int) -> None:
        super().__init__(config, seed)
        self.max_turns = config.max_turns
        self._count = 0
        self._held: set[str] = set()  # held-out expressions, never sampled for training

    def _expression(self, rng: random.Random) -> list[str]:
        c = self.config
        words = [rng.choice(DIGITS)]
        for _ in range(c.operands - 1):
            words += [rng.choice(c.operators), rng.choice(DIGITS)]
        return words

    def _prompt(self, prompt_id: str, words: list[str]) -> Prompt:
        return Prompt(prompt_id, f"user {' '.join(words)} ? assistant", evaluate("".join(words)))

    def sample(self, n: int) -> list[Prompt]:
        out = []
        while len(out) < n:
            words = self._expression(self.rng)
            if " ".join(words) in self._held:
                continue
            self._count += 1
            out.append(self._prompt(f"c{self._count}", words))
        return out

    def held_out(self, n: int) -> list[Prompt]:
        """`n` expressions from a fixed seed, kept out of `sample` from then on (at most a
        quarter of the distinct ones)."""
        space = 10**self.config.operands * len(self.config.operators) ** (self.config.operands - 1)
        rng, chosen = random.Random(104729), list[list[str]]()
        while len(chosen) < min(n, space // 4):
            words = self._expression(rng)
            if words not in chosen:
                chosen.append(words)
        self._held = {" ".join(w) for w in chosen}
        return [self._prompt(f"eval{i}", w) for i, w in enumerate(chosen)]

    def start(self, prompt: Prompt) -> CalculatorEpisode:
        return CalculatorEpisode(prompt.reference, self.config.format_reward)

    def vocabulary(self) -> set[str]:
        return {*DIGITS, *self.config.operators, "?", "user", "assistant", "tool", "result", "call", "answer"}
