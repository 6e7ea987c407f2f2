"""Tasks: the math answer checker, datasets from local files, the multi-turn calculator
environment, and multi-turn episodes through an engine and into the learner's batch."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sluice.config.loader import ConfigError
from sluice.config.model import VOCABULARIES
from sluice.config.rollout import SimEngineConfig
from sluice.config.task import TaskConfig
from sluice.learner.batch import collate
from sluice.rollout_svc.engines.base import SamplingParams
from sluice.rollout_svc.engines.sim import SimEngine
from sluice.rollout_svc.episodes import GroupRequest, multi_turn
from sluice.rollout_svc.tasks.calculator import CalculatorConfig, CalculatorEpisode, CalculatorTask, evaluate
from sluice.rollout_svc.tasks.math_check import answers_match, extract_answer, math_reward
from sluice.rollout_svc.tasks.registry import build_task
from sluice.trajectory import Trajectory


@pytest.mark.parametrize(
    ("completion", "reference", "expected"),
    [
        ("so the answer is 42.", "42", 1.0),
        ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
        ("we get \\boxed{\\dfrac{1}{2}} done", "2/4", 1.0),
        ("Answer: 1,234", 1234, 1.0),
        ("answer 1 2", "12", 1.0),  # digit-level tokens
        ("x = 7 then 8", "8", 1.0),  # last number
        ("\\boxed{2x+2}", "2*(x+1)", 1.0),  # symbolic
        ("\\boxed{50\\%}", "50", 1.0),
        ("the answer is 41", "42", 0.0),
        ("no number here", "3", 0.0),
        ("\\boxed{__import__('os')}", "0", 0.0),  # never evaluated
    ],
)
def test_math_checker(completion, reference, expected):
    assert math_reward(completion, reference) == expected


def test_math_checker_extraction_order():
    assert extract_answer("first 3 then \\boxed{5} answer 7") == "5"
    assert extract_answer("answer: 12 because 3") == "12 because 3"
    assert extract_answer("nothing") is None
    assert not answers_match(None, "1")


ROWS = [{"question": "2 + 3 =", "solution": "5"}, {"question": "4 * 2 =", "solution": "8"}]


def _task(path, **params):
    fields = {"prompt_field": "question", "answer_field": "solution"}
    return build_task(TaskConfig(name="dataset", params={"path": str(path), **fields, **params}), seed=0)


def _check_dataset_task(task):
    prompts = task.sample(5)  # more than one epoch of 2 rows
    assert {p.text for p in prompts} == {"2 + 3 =", "4 * 2 ="}
    assert len({p.prompt_id for p in prompts}) == 5
    by_text = {p.text: p for p in prompts}
    assert task.score(by_text["2 + 3 ="], "answer 5", True).reward == 1.0
    assert task.score(by_text["4 * 2 ="], "answer 9", True).reward == 0.0
    assert task.vocabulary() >= {"2", "+", "3", "=", "5", "8"}


def test_dataset_task_reads_jsonl_parquet_and_hf_dirs(tmp_path):
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    _check_dataset_task(_task(jsonl))

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    _check_dataset_task(_task(tmp_path / "d.parquet"))

    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "hf"))
    _check_dataset_task(_task(tmp_path / "hf"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "hfdict"))
    _check_dataset_task(_task(tmp_path / "hfdict", split="train"))


def test_dataset_task_errors_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        _task(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1", "solution": "1"}\nnot json\n')
    with pytest.raises(ConfigError, match="bad.jsonl:2: not JSON"):
        _task(bad)
    (tmp_path / "nofield.jsonl").write_text('{"question": "1"}\n')
    with pytest.raises(
        ConfigError, match=r"^config error: task.params.answer_field='solution': row 0 .*no such column"
    ):
        _task(tmp_path / "nofield.jsonl")
    with pytest.raises(ConfigError, match="task.params.reward: unknown key"):
        _task(bad, reward="exact")  # rewards are task.rewards now, for every task


def test_calculator_environment_by_hand():
    assert evaluate("3+4*2") == 11 and evaluate("-(2-5)") == 3
    for bad in ("__import__('os')", "2**99", "1/2", "", "x"):
        with pytest.raises(ValueError):
            evaluate(bad)
    ep = CalculatorEpisode(answer=11, format_reward=0.1)
    reply = ep.respond("call 3 + 4 * 2", finished=True)
    assert reply.text == "tool result 1 1 assistant" and not reply.done
    assert ep.respond("call 3 + +", finished=True).text == "tool result ? assistant"
    final = ep.respond("answer 1 1", finished=True)
    assert final.done and final.reward == 1.0 and final.info["calls"] == 2
    assert CalculatorEpisode(11, 0.1).respond("answer 1 2", True).reward == 0.1
    assert CalculatorEpisode(11, 0.1).respond("3 4", True).reward == 0.0
    assert CalculatorEpisode(11, 0.1).respond("call 3", finished=False).done  # cut mid-turn


def test_multi_turn_episodes_through_an_engine_into_the_learner_batch():
    """The sim engine writes random arith tokens; seeded, some turns are tool calls, so some
    episodes run several turns. Check the structure every episode must have."""
    task = CalculatorTask(CalculatorConfig(max_turns=3), seed=0)
    engine = SimEngine(VOCABULARIES["arith"], 64, SimEngineConfig(eos_prob=0.3), seed=0)
    engine.sleep = lambda s: None
    tok = engine.tokenizer
    prompts = task.sample(40)
    prompt_ids = [[tok.bos_token_id, *tok.encode(p.text)] for p in prompts]
    groups = multi_turn(
        engine, task, GroupRequest(prompts, prompt_ids, 4, SamplingParams(6, 1.0), None, None)
    )
    multi = 0
    trajs = []
    for p, ids, g in zip(prompts, prompt_ids, groups):
        assert len(g) == 4
        for s in g:
            assert len(s.completion_ids) == len(s.logprobs) == len(s.versions) == len(s.loss_mask)
            assert len(ids) + len(s.completion_ids) <= 64
            env = s.loss_mask == 0
            assert np.all(s.logprobs[env] == 0) and np.all(s.logprobs[~env] < 0)
            assert 1 <= s.info["turns"] <= 3
            if s.info["turns"] > 1:
                multi += 1
                text = tok.decode(s.completion_ids[env].tolist())
                assert text.startswith("tool result") and "assistant" in text
            trajs.append(
                Trajectory(
                    traj_id=str(len(trajs)),
                    group_id=p.prompt_id,
                    version=s.version,
                    arrays={
                        "prompt_ids": np.asarray(ids, dtype=np.int32),
                        "completion_ids": s.completion_ids,
                        "behaviour_logprobs": s.logprobs,
                        "loss_mask": s.loss_mask,
                    },
                )  # fmt: skip
            )
    assert multi > 0
    batch = collate(trajs, tok.pad_token_id)
    assert int(batch.completion_mask.sum()) == sum(int(t.arrays["loss_mask"].sum()) for t in trajs)
    assert torch.all(batch.behaviour_logprobs[~batch.completion_mask] == 0)
