"""Plugins by reference (sluice/plugins.py) and what runs user code: the reward pool with its
deadlines and error policy (rollout_svc/calls.py, scoring.py), chat prompts, and tasks,
engines and environments named by reference."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time

import pytest
from helpers.runs import ROOT

from sluice.config import load_config
from sluice.config.loader import ConfigError
from sluice.config.task import TaskConfig
from sluice.plugins import PluginError, resolve
from sluice.rollout_svc.calls import Call, CallPool
from sluice.rollout_svc.scoring import RewardError, Scorer, ToScore, build_rewards
from sluice.rollout_svc.tasks.base import Prompt
from sluice.rollout_svc.tasks.registry import build_task


def write(path, text: str):
    path.write_text(textwrap.dedent(text))
    return path


# -- the resolver ------------------------------------------------------------------------------


def test_resolve_builtin_module_file_and_entry_point(tmp_path, monkeypatch):
    assert resolve("copy", "tasks", "task.name", {"copy": 7}) == 7
    assert resolve("textwrap:dedent", "rewards", "k") is textwrap.dedent
    f = write(tmp_path / "mine.py", "def fn(**kw):\n    return 1.0\nclass A:\n    class B:\n        x = 3\n")
    got = resolve(f"{f}:fn", "rewards", "k")
    assert got() == 1.0 and resolve(f"{f}:fn", "rewards", "k") is got  # the file is imported once
    assert resolve(f"{f}:A.B", "rewards", "k").x == 3
    # an installed distribution's entry point, found on sys.path like any installed package
    dist = tmp_path / "site" / "toy_plugin-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[sluice.rewards]\ntoy = toy_plugin_mod:score\n")
    write(tmp_path / "site" / "toy_plugin_mod.py", "def score(**kw):\n    return 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert resolve("toy", "rewards", "task.rewards.0.fn")() == 0.5


def test_bad_references_are_one_line_naming_the_key(tmp_path):
    raises = write(tmp_path / "raises.py", "import no_such_module_xyz\n")
    cases = {
        "nope": "not a built-in or registered name (known: ['copy'])",
        "no_such_module_xyz:f": "cannot import no_such_module_xyz: ModuleNotFoundError",
        "textwrap:nope": "textwrap has no attribute 'nope'",
        f"{tmp_path}/missing.py:f": "no file",
        f"{raises}:f": "importing raises.py raised ModuleNotFoundError: No module named 'no_such_module_xyz'",
    }
    for ref, why in cases.items():
        with pytest.raises(PluginError) as e:
            resolve(ref, "tasks", "task.name", {"copy": 1})
        text = str(e.value)
        assert text.startswith(f"config error: task.name: {ref!r}: ") and why in text, text
        assert "\n" not in text


def test_file_references_become_absolute_when_the_config_loads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["task.name=tasks/mine.py:MyTask", "task.rewards=[{fn: r.py:f}]"])
    assert cfg.task.name == f"{tmp_path}/tasks/mine.py:MyTask"
    assert cfg.task.rewards[0].fn == f"{tmp_path}/r.py:f"
    assert load_config(None, ["task.name=pkg.mod:MyTask"]).task.name == "pkg.mod:MyTask"


# -- the call pool -----------------------------------------------------------------------------


def test_call_pool_gives_values_errors_and_timeouts():
    def double(x):
        return 2 * x

    def boom():
        raise ValueError("boom")

    def hang():
        time.sleep(3)

    async def later(x):
        await asyncio.sleep(0.01)
        return x

    async def forever():
        await asyncio.sleep(60)

    pool = CallPool(workers=2, timeout_s=0.3)
    try:
        calls = [
            Call(double, {"x": 1}),
            Call(boom, {}),
            Call(later, {"x": 3}),
            Call(forever, {}),
            Call(hang, {}),
        ]
        t0 = time.monotonic()
        got = pool.run(calls)
        assert time.monotonic() - t0 < 2.5  # the hung thread is given up on, not waited for
        assert [r.status for r in got] == ["ok", "error", "ok", "timeout", "timeout"]
        assert got[0].value == 2 and got[2].value == 3
        assert "ValueError: boom" in got[1].error and "Traceback" in got[1].error
        # both workers held by hung calls: further calls fail at once instead of queueing forever
        pool.run([Call(hang, {})])
        assert pool.run([Call(double, {"x": 1})])[0].status == "timeout"
    finally:
        pool.close()


# -- scoring -----------------------------------------------------------------------------------

REWARDS = """
import asyncio

def length(prompt, completion, reference):
    return float(len(completion.split()))

async def matches(prompt, completion, reference, **row):
    await asyncio.sleep(0.001)
    return {"reward": float(completion == reference), "bonus_seen": float(row["bonus"])}

def picky(prompt, completion, reference, finished):  # names only `finished` of the extras
    return 1.0 if finished else 0.0

def flaky(prompt, completion, reference):
    if completion == "bad":
        raise RuntimeError("checker crashed on " + completion)
    return 1.0

def slow(prompt, completion, reference):
    import time
    if completion == "slow":
        time.sleep(1.0)
    return 1.0

def not_a_number(prompt, completion, reference):
    return "high"
"""


def scorer(tmp_path, rewards, on_error="fail"):
    f = tmp_path / "rewards.py"
    if not f.exists():
        write(f, REWARDS)
    cfg = TaskConfig(
        name="copy",
        rewards=[{"fn": f"{f}:{name}", "weight": w} for name, w in rewards],
        scoring={"workers": 2, "timeout_s": 0.3, "on_error": on_error},
    )
    return Scorer(build_task(cfg, seed=0), cfg)


def items(*completions, finished=True):
    p = Prompt("p1", "1 2", "1 2", row={"bonus": 3})
    return [ToScore(p, c, finished) for c in completions]


def test_reward_functions_weighted_with_metrics_and_only_the_columns_they_name(tmp_path):
    s = scorer(tmp_path, [("length", 0.5), ("matches", 2.0), ("picky", 1.0)])
    try:
        batch = s.score([items("1 2", "3"), items("1 2 3", finished=False)])
        (a, b), (c,) = batch.groups
        assert a.reward == 0.5 * 2 + 2.0 * 1 + 1.0 and b.reward == 0.5 * 1 + 0 + 1.0
        assert c.reward == 0.5 * 3 + 0 + 0.0  # not finished
        assert a.info == {"reward_length": 2.0, "reward_matches": 1.0, "bonus_seen": 3.0, "reward_picky": 1.0}
        assert batch.components["reward_matches"] == [1.0, 0.0, 0.0] and batch.errors == 0
    finally:
        s.close()


def test_a_reward_that_raises_fails_skips_its_group_or_scores_zero_never_silently(tmp_path, caplog):
    s = scorer(tmp_path, [("flaky", 1.0)])
    with pytest.raises(
        RewardError, match=r"(?s)reward 'flaky' on prompt p1 raised:.*Traceback.*checker crashed"
    ):
        s.score([items("ok", "bad")])
    s.close()
    s = scorer(tmp_path, [("flaky", 1.0)], on_error="skip_group")
    batch = s.score([items("ok", "bad"), items("ok", "ok")])
    assert batch.groups[0] is None and [x.reward for x in batch.groups[1]] == [1.0, 1.0]
    assert batch.skipped_groups == 1 and batch.errors == 1
    assert "checker crashed on bad" in caplog.text and "Traceback" in caplog.text
    s.close()
    s = scorer(tmp_path, [("flaky", 1.0), ("not_a_number", 1.0)], on_error="zero")
    batch = s.score([items("ok")])
    assert batch.groups[0][0].reward == 1.0 and batch.errors == 1  # the non-number counts as an error
    assert "returned str 'high', not a number" in caplog.text
    s.close()


def test_a_reward_past_its_deadline_is_counted(tmp_path):
    s = scorer(tmp_path, [("slow", 1.0)], on_error="zero")
    try:
        batch = s.score([items("slow", "fast")])
        assert [x.reward for x in batch.groups[0]] == [0.0, 1.0] and batch.timeouts == 1
    finally:
        s.close()


def test_the_tasks_own_score_runs_under_the_same_policy(tmp_path):
    task = write(
        tmp_path / "task.py",
        """
        from sluice.config.base import Section
        from sluice.rollout_svc.tasks.base import Prompt, Score, Task

        class Broken(Task):
            Config = Section
            def sample(self, n):
                return [Prompt(f"b{i}", "1", "1") for i in range(n)]
            def score(self, prompt, completion, finished):
                raise KeyError("no such answer")
        """,
    )
    cfg = TaskConfig(name=f"{task}:Broken", scoring={"on_error": "skip_group"})
    s = Scorer(build_task(cfg, seed=0), cfg)
    try:
        assert build_task(cfg, 0).name == "Broken"
        batch = s.score([items("1")])
        assert batch.groups == [None] and batch.errors == 1
    finally:
        s.close()


def test_reward_config_errors_name_the_key(tmp_path):
    write(tmp_path / "r.py", "x = 3\n")
    with pytest.raises(ConfigError, match=r"^config error: task.rewards.0.fn: .*is a int, not a function$"):
        build_rewards(TaskConfig(rewards=[{"fn": f"{tmp_path}/r.py:x"}]), build_task(TaskConfig(), 0))
    with pytest.raises(ConfigError, match="task.rewards: 'calculator' is multi-turn"):
        cfg = TaskConfig(name="calculator", rewards=[{"fn": "exact"}])
        build_rewards(cfg, build_task(cfg, 0))
    with pytest.raises(ConfigError, match=r"config error: task.rewards: reward names must be unique"):
        load_config(None, ["task.rewards=[{fn: exact, name: a}, {fn: math, name: a}]"])


# -- chat prompts --------------------------------------------------------------------------------

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)


def test_a_chat_dataset_round_trips_through_the_chat_template(tmp_path):
    import json

    from sluice.modeling.tokenizer import build_tokenizer
    from sluice.rollout_svc.service import prompt_token_ids

    rows = [
        {"messages": [{"role": "user", "content": "2 + 3 ="}], "answer": "5", "level": 1},
        {
            "messages": [{"role": "system", "content": "env"}, {"role": "user", "content": "1 + 1 ="}],
            "answer": "2",
            "level": 2,
        },
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    params = {"path": str(data), "prompt_field": "messages", "system_prompt": "sum", "shuffle": False}
    task = build_task(TaskConfig(name="dataset", params=params), seed=0)
    first, second = task.sample(2)
    assert first.messages == [{"role": "system", "content": "sum"}, {"role": "user", "content": "2 + 3 ="}]
    assert first.row == {"level": 1} and first.reference == "5"
    assert second.messages[0] == {"role": "system", "content": "env"}  # its own system message stays

    from sluice.config.model import VOCABULARIES

    tok = build_tokenizer([*VOCABULARIES["arith"], "system"])
    with pytest.raises(ConfigError, match="model.chat_template"):
        prompt_token_ids(tok, first)
    tok.chat_template = CHAT_TEMPLATE
    ids = prompt_token_ids(tok, first)
    assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids
    assert tok.decode(ids[1:]) == "system sum user 2 + 3 = assistant"

    plain = build_task(
        TaskConfig(name="dataset", params={**params, "chat": "on", "prompt_field": "answer"}), 0
    )
    assert plain.sample(1)[0].messages == [
        {"role": "system", "content": "sum"},
        {"role": "user", "content": "5"},
    ]
    off = r"^config error: task.params.chat=off: row 0's 'messages' is a chat$"
    with pytest.raises(ConfigError, match=off):
        build_task(TaskConfig(name="dataset", params={**params, "chat": "off"}), 0)


# -- engines and environments by reference -------------------------------------------------------


def test_an_engine_and_an_environment_by_reference(tmp_path):
    from sluice.rollout_svc.engines.registry import build_engine

    mod = write(
        tmp_path / "mine.py",
        """
        import gymnasium as gym
        from sluice.rollout_svc.engines.sim import SimEngine

        class Echo(SimEngine):
            def __init__(self, cfg, seed):
                init = cfg.model.init
                super().__init__(init.tokens(), init.max_position_embeddings, cfg.rollout.sim, seed=seed)
                self.built_by_user = True

        def not_an_engine(cfg, seed):
            return object()

        def cartpole(**kwargs):
            return gym.make("CartPole-v1", **kwargs)
        """,
    )
    cfg = load_config(None, [f"rollout.engine={mod}:Echo", "run.dir=" + str(tmp_path)])
    assert build_engine(cfg, seed=0).built_by_user
    with pytest.raises(TypeError, match="built a object, not a sluice Engine"):
        build_engine(load_config(None, [f"rollout.engine={mod}:not_an_engine"]), seed=0)

    from sluice.config.env import EnvConfig
    from sluice.modeling.policy import env_spaces
    from sluice.rollout_svc.envs.gym_runner import GymRunner

    assert env_spaces(f"{mod}:cartpole", {}) == (4, 2)
    assert GymRunner(EnvConfig(id=f"{mod}:cartpole", num_envs=2), seed=0).obs.shape == (2, 4)
    with pytest.raises(PluginError, match=r"^config error: env.id: .*has no attribute 'nope'$"):
        env_spaces(f"{mod}:nope", {})


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "task.name=no_such_pkg.tasks:Mine",
            "config error: task.name: 'no_such_pkg.tasks:Mine': cannot import",
        ),
        (
            "task.rewards=[{fn: no_such_pkg:f}]",
            "config error: task.rewards.0.fn: 'no_such_pkg:f': cannot import",
        ),
        ("rollout.engine=nope", "config error: rollout.engine: 'nope': not a built-in or registered name"),
    ],
)
def test_sluice_run_refuses_a_bad_reference_before_starting_anything(tmp_path, override, expected):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sluice.cli",
            "run",
            "configs/quickstart.yaml",
            override,
            f"run.dir={tmp_path}/run",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(expected), proc.stderr
    assert not (tmp_path / "run" / "logs").exists()
