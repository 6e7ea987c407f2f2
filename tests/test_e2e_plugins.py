"""User code without editing Sluice, end to end through real `sluice run` processes: an installed
plugin package found by entry points (examples/sluice-plugin-example: a task, two rewards one
of them async, a custom loss), the same task and rewards by file reference (under the Ray
launcher: tests/test_ray_launcher.py's every-role run), and a reward that raises failing the
run with its traceback, not restarted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.plugin_example import EXAMPLE, REWARDS_BY_NAME, TASK_BY_FILE, rewards_by_file
from helpers.runs import ROOT, sluice_run

from sluice.metrics import read_jsonl

pytestmark = pytest.mark.slow


def install_example(target: Path) -> dict[str, str]:
    """pip-install the example package into `target`; the environment that finds it."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(EXAMPLE),
        ],
        check=True,
        timeout=300,
    )
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")])),
    }


def learned(run_dir: Path, gain: float) -> list[float]:
    """The learner's batch reward rose by `gain` from its first 10 steps to its best 10 (of the
    non-overlapping tenths of the second half). Its best, not its last: the example's loss is
    REINFORCE with no importance ratio, trained one version off-policy at the quickstart's
    max_staleness 1, and can fall back late. In the slow suite (2026-12-06) a run rose 0.078 ->
    0.303 by step 80, then its completions lengthened into truncation, its grad norm hit 5-8 and
    its last 10 steps averaged 0.2 (two CIs failed the old last-10 check: gains of 0.037 and
    0.055). 16 runs alone here (seeds 0-8) ended 0.34-0.40. A run that learns nothing moves a
    10-step mean of 128-sample batches by ~0.01 (sd), its best tenth by ~0.02."""
    steps = read_jsonl(run_dir / "metrics" / "learner.jsonl")
    rewards = [r["reward_mean"] for r in steps]
    by_tenth = tenths(rewards)
    first, best = sum(rewards[:10]) / 10, max(by_tenth[len(by_tenth) // 2 :])
    if not best > first + gain:  # the whole account, not pytest's truncated repr of it
        account = json.dumps(run_account(run_dir, steps))
        pytest.fail(f"batch reward {first:.3f} -> best {best:.3f}, wanted a gain over {gain}:\n{account}")
    return rewards


def run_account(run_dir: Path, steps: list[dict]) -> dict:
    """What a run did that bears on how it learned: restarts, versions, staleness, and each
    service's reward by tenths of its batches."""
    events = read_jsonl(run_dir / "metrics" / "launcher.jsonl")
    services = {}
    for f in sorted((run_dir / "metrics").glob("rollout-*.jsonl")):
        records = [x for x in read_jsonl(f) if "reward_mean" in x]
        services[f.stem] = {
            "records": len(records),
            "versions": sorted({x.get("version") for x in records} - {None})[-3:],
            "rewards": tenths([x["reward_mean"] for x in records]),
        }
    last = steps[-1] if steps else {}
    return {
        "steps": len(steps),
        "versions": [s["version"] for s in steps],
        "events": [(e["event"], e.get("role")) for e in events if e["event"] != "learner_step"],
        "staleness_mean": round(sum(s["staleness_mean"] for s in steps) / max(1, len(steps)), 2),
        "learner_rewards": tenths([s["reward_mean"] for s in steps]),
        "totals": {k: v for k, v in last.items() if k.startswith("total_")},
        "rollout_rewards": services,
    }


def tenths(values: list[float]) -> list[float]:
    """`values` averaged over each tenth of their length (3 decimals)."""
    n = max(1, len(values) // 10)
    return [round(sum(values[i : i + n]) / len(values[i : i + n]), 3) for i in range(0, len(values), n)]


def rollout_record(run_dir: Path) -> dict:
    return read_jsonl(run_dir / "metrics" / "rollout-0.jsonl")[-1]


def test_an_installed_plugin_package_is_found_by_entry_points_and_trains(tmp_path):
    env = install_example(tmp_path / "site")
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable, "-m", "sluice.cli", "run", str(ROOT / "configs" / "quickstart.yaml"),
            f"run.dir={run_dir}", "rollout.engine=hf", "--no-progress",
            "task.name=first_digit", REWARDS_BY_NAME,
            "workflow.learner.1.loss={type: reinforce, params: {scale: 1.0}}",  # the quickstart's grpo.yaml
            "learner.total_steps=100", "task.eval.every=25", "task.eval.prompts=16",
        ],
        capture_output=True, text=True, timeout=400, cwd=ROOT, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    learned(run_dir, gain=0.1)
    record = rollout_record(run_dir)
    assert {"mean/reward_first_digit_right", "mean/reward_stops_after_one", "mean/prompt_digits"} <= set(
        record
    )
    assert record["reward_errors"] == 0 and record["reward_timeouts"] == 0
    assert "logp_mean" in read_jsonl(run_dir / "metrics" / "learner.jsonl")[-1]  # the custom loss's metric
    evals = read_jsonl(run_dir / "metrics" / "eval.jsonl")
    assert len(evals) >= 4 and {"greedy_reward", "sampled_reward"} <= set(evals[-1])


def test_a_task_and_rewards_from_files_outside_the_package_train(tmp_path):
    run_dir = tmp_path / "run"
    proc = sluice_run(
        run_dir,
        TASK_BY_FILE,
        rewards_by_file(),
        "learner.total_steps=30",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(read_jsonl(run_dir / "metrics" / "learner.jsonl")) == 30  # (learning: the installed test)
    assert "mean/reward_first_digit_right" in rollout_record(run_dir)


def test_a_reward_that_raises_fails_the_run_with_its_traceback_and_no_restart(tmp_path):
    bad = tmp_path / "bad_reward.py"
    bad.write_text(
        "def strict(prompt, completion, reference):\n    raise LookupError(f'no checker for {reference!r}')\n"
    )
    run_dir = tmp_path / "run"
    proc = sluice_run(run_dir, f"task.rewards=[{{fn: '{bad}:strict'}}]", timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert "exited with code 3" in output and "LookupError: no checker for" in output  # shown to the user
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("rollout-*.log"))
    assert "Traceback" in logs and "LookupError: no checker for" in logs and "on_error=fail" in logs
    events = [e["event"] for e in read_jsonl(run_dir / "metrics" / "launcher.jsonl")]
    assert "restarted" not in events  # a restart would fail the same way


def test_with_skip_group_a_raising_reward_costs_its_groups_and_the_run_goes_on(tmp_path):
    flaky = tmp_path / "flaky_reward.py"
    flaky.write_text(
        "def flaky(prompt, completion, reference):\n"
        "    if reference[0] == '7':  # a checker that cannot handle one prompt in ten\n"
        "        raise RuntimeError('checker crashed')\n"
        "    return float(completion.split() == reference)\n"
    )
    run_dir = tmp_path / "run"
    proc = sluice_run(
        run_dir,
        f"task.rewards=[{{fn: '{flaky}:flaky'}}]",
        "task.scoring.on_error=skip_group",
        "learner.total_steps=30",
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert len(read_jsonl(run_dir / "metrics" / "learner.jsonl")) == 30
    records = [r for i in (0, 1) for r in read_jsonl(run_dir / "metrics" / f"rollout-{i}.jsonl")]
    skipped = sum(r["skipped_groups"] for r in records)
    assert skipped > 0 and sum(r["reward_errors"] for r in records) >= skipped
    assert "checker crashed" in (run_dir / "logs" / "rollout-0.log").read_text()
