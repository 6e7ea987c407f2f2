"""From prompts to scored samples, single turn or multi turn, through any engine.

Single turn: each prompt is completed `n` times in one engine call and each completion scored
(scoring.py: the task's score or its reward functions, in a pool with deadlines).

Multi turn: `n` episodes per prompt. Every turn, one engine call completes the context of each
live episode (prompt + every earlier model turn and environment reply); the episode's
`respond` then ends it with a reward or replies, and the reply's tokens join the context.
Model tokens carry their behaviour log-prob and version; environment tokens carry log-prob 0,
the version current when they were added (never older than the model tokens before them), and
loss_mask 0 so the learner does not train on them. An episode that runs out of turns or of
context is cut short (`truncated`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from sluice.rollout_svc.engines.base import Completion, Engine, InterruptPoll, SamplingParams, TokenCodec
from sluice.rollout_svc.scoring import ScoredBatch, Scorer, ToScore
from sluice.rollout_svc.tasks.base import EnvReply, Episode, MultiTurnTask, Prompt, Score
from sluice.wire.messages import Scalar


@dataclass
class Sample:
    completion_ids: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T], 0 at environment tokens
    versions: np.ndarray  # int32 [T]
    loss_mask: np.ndarray | None  # uint8 [T], 1 = model token; None: every token is the model's
    finished: bool  # ended by end-of-sequence (single turn) or by the environment (multi turn)
    reward: float
    info: dict[str, Scalar]
    discarded_tokens: int  # sampled, then thrown away by abort-mode restarts

    @property
    def version(self) -> int:
        """The oldest policy version that sampled any of its tokens."""
        model = self.versions if self.loss_mask is None else self.versions[self.loss_mask.astype(bool)]
        return int(model.min()) if len(model) else -1


@dataclass(frozen=True)
class GroupRequest:
    """What to roll out: `n` samples (completions or episodes) for each prompt."""

    prompts: Sequence[Prompt]
    prompt_ids: Sequence[list[int]]  # each prompt tokenized, BOS first
    n: int
    params: SamplingParams
    interrupt: InterruptPoll | None  # new weights to take between decode steps
    truncated_reward: float | None  # the reward of a sample cut at its budget (None: as scored)


def single_turn(engine: Engine, scorer: Scorer, req: GroupRequest) -> tuple[list[list[Sample]], ScoredBatch]:
    """Complete each prompt `n` times and score every completion (all of a batch's reward
    calls at once). A group its scorer skips comes back empty."""
    groups = engine.generate(req.prompt_ids, req.n, req.params, req.interrupt)
    tok = engine.tokenizer
    texts = [[tok.decode(c.token_ids.tolist(), skip_special_tokens=True) for c in g] for g in groups]
    scored = scorer.score(
        [[ToScore(p, t, c.finished) for t, c in zip(ts, g)] for p, ts, g in zip(req.prompts, texts, groups)]
    )
    out = []
    for group, scores in zip(groups, scored.groups):
        if scores is None:
            out.append([])
            continue
        out.append([to_sample(c, score, req.truncated_reward) for c, score in zip(group, scores)])
    return out, scored


def to_sample(c: Completion, score: Score, truncated_reward: float | None) -> Sample:
    """A scored completion (a sample cut at its budget gets `truncated_reward` if set)."""
    reward = score.reward if c.finished or truncated_reward is None else truncated_reward
    info = {**score.info, "truncated": not c.finished}
    return Sample(c.token_ids, c.logprobs, c.versions, None, c.finished, reward, info, c.discarded_tokens)


@dataclass
class _EpisodeState:
    prompt_index: int
    episode: Episode
    context: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    discarded: int = 0
    ending: EnvReply | None = None
    truncated: bool = False

    def add_model(self, c: Completion) -> None:
        ids = c.token_ids.tolist()
        self.context += ids
        self.tokens += ids
        self.logprobs += c.logprobs.tolist()
        self.versions += c.versions.tolist()
        self.mask += [1] * len(ids)
        self.turns += 1
        self.discarded += c.discarded_tokens

    def add_env(self, ids: list[int], version: int) -> None:
        self.context += ids
        self.tokens += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)
        self.mask += [0] * len(ids)

    def end(self, reply: EnvReply, truncated: bool) -> None:
        self.ending, self.truncated = reply, truncated

    def sample(self, truncated_reward: float | None) -> Sample:
        assert self.ending is not None
        reward = self.ending.reward
        if self.truncated and truncated_reward is not None:
            reward = truncated_reward
        return Sample(
            np.asarray(self.tokens, dtype=np.int32),
            np.asarray(self.logprobs, dtype=np.float32),
            np.asarray(self.versions, dtype=np.int32),
            np.asarray(self.mask, dtype=np.uint8),
            not self.truncated,
            reward,
            {**self.ending.info, "truncated": self.truncated, "turns": self.turns},
            self.discarded,
        )


def multi_turn(engine: Engine, task: MultiTurnTask, req: GroupRequest) -> list[list[Sample]]:
    prompts, prompt_ids, n, params = req.prompts, req.prompt_ids, req.n, req.params
    tok: TokenCodec = engine.tokenizer
    episodes = [
        _EpisodeState(i, task.start(prompt), list(prompt_ids[i]))
        for i, prompt in enumerate(prompts)
        for _ in range(n)
    ]
    for _ in range(task.max_turns):
        live = [e for e in episodes if e.ending is None]
        for e in live:
            if len(e.context) >= engine.max_model_len:
                e.end(e.episode.cut_short(), truncated=True)
        live = [e for e in live if e.ending is None]
        if not live:
            break
        completions = engine.generate([e.context for e in live], 1, params, req.interrupt)
        for e, (c,) in zip(live, completions):
            e.add_model(c)
            reply = e.episode.respond(tok.decode(c.token_ids.tolist(), skip_special_tokens=True), c.finished)
            if reply.text is None:  # reply.done: the episode ended
                e.end(reply, truncated=False)
                continue
            ids = tok.encode(reply.text, add_special_tokens=False)
            if len(e.context) + len(ids) >= engine.max_model_len:  # no room left for a model turn
                e.end(e.episode.cut_short(), truncated=True)
            else:
                e.add_env(ids, engine.version)
    for e in episodes:
        if e.ending is None:
            e.end(e.episode.cut_short(), truncated=True)
    return [
        [e.sample(req.truncated_reward) for e in episodes[i * n : (i + 1) * n]] for i in range(len(prompts))
    ]
