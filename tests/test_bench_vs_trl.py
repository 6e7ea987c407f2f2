"""benchmarks/vs_trl.py: the stop rule and summary arithmetic against hand-computed numbers, and
smoke runs of --quick (Sluice and the bound; TRL too when it is installed)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from helpers.bench_scripts import ROOT, run_script


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import vs_trl

    return vs_trl


def curve(rewards: list[float], dt: float = 0.5) -> list[dict]:
    return [{"step": i + 1, "time_s": dt * (i + 1), "reward": r, "tokens": 10} for i, r in enumerate(rewards)]


def test_trailing_mean_and_crossings(bench):
    rewards = [0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    means = bench.trailing_means(rewards)
    assert means[:4] == [None] * 4  # no 5-step window yet
    assert means[4:] == pytest.approx([0.7, 0.9, 1.0])
    cross = bench.crossings(curve(rewards))
    assert cross == {"0.5": {"step": 5, "time_s": 2.5}, "0.7": {"step": 5, "time_s": 2.5},
                     "0.9": {"step": 6, "time_s": 3.0}}  # fmt: skip
    assert not bench.reached(rewards[:5]) and bench.reached(rewards[:6])


def test_sluice_adv_eps_is_trls_hard_coded_one(bench):
    assert bench.ADV_EPS == 1e-4  # TRL 1.16's group advantages divide by std + 1e-4


def test_summary_stops_at_the_threshold(bench):
    s = bench.summarize_curve(curve([0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0]))
    # counted up to step 6 (where 0.9 was reached), not the 7th step that ran meanwhile
    assert s["reached"] and s["steps"] == 6 and s["time_s"] == 3.0
    assert s["tokens_per_s"] == pytest.approx(60 / 3.0) and s["s_per_step"] == pytest.approx(0.5)
    none = bench.summarize_curve(curve([0.1] * 8))
    assert not none["reached"] and none["steps"] == 8 and none["crossings"]["0.9"] is None


def bench_run(system, seed, step, t, ran=None):
    """A run record: reached 0.9 at (step, t), or stopped short at `ran` = (steps, seconds)."""
    crossing = {"step": step, "time_s": t} if step is not None else None
    last_step, last_t = ran or (step, t)
    return {"system": system, "task": "copy", "seed": seed, "crossings": {"0.9": crossing},
            "curve": [{"step": last_step, "time_s": last_t}]}  # fmt: skip


def test_ratios_over_seeds(bench):
    runs = [bench_run("trl", 0, 100, 50.0), bench_run("sluice", 0, 120, 40.0),
            bench_run("trl", 1, 100, 50.0), bench_run("sluice", 1, 100, 60.0)]  # fmt: skip
    s = bench.summarize(runs, ["copy"], [0, 1])["copy"]
    assert [r["time_ratio"] for r in s["per_seed"]] == pytest.approx([0.8, 1.2])
    assert [r["steps_ratio"] for r in s["per_seed"]] == pytest.approx([1.2, 1.0])
    assert s["median_time_ratio"] == pytest.approx(1.0)
    assert s["sluice_faster_every_seed"] is False


def test_a_seed_only_one_system_finished_counts_with_a_bound_against_sluice(bench):
    runs = [bench_run("trl", 0, None, None, ran=(1500, 100.0)), bench_run("sluice", 0, 300, 20.0),
            bench_run("trl", 1, 200, 10.0), bench_run("sluice", 1, None, None, ran=(1000, 40.0)),
            bench_run("trl", 2, None, None, ran=(1500, 90.0)),
            bench_run("sluice", 2, None, None, ran=(1500, 70.0))]  # fmt: skip
    s = bench.summarize(runs, ["copy"], [0, 1, 2])["copy"]
    only_sluice, only_trl, neither = s["per_seed"]
    assert only_sluice["censored"] == "at most" and only_sluice["time_ratio"] == pytest.approx(0.2)
    assert only_sluice["steps_ratio"] == pytest.approx(0.2)
    assert only_trl["censored"] == "at least" and only_trl["time_ratio"] == pytest.approx(4.0)
    assert "time_ratio" not in neither  # no verdict where neither reached it
    # against Sluice: the upper bound counts as 0.2, the lower bound as larger than any ratio
    assert s["median_time_ratio"] is None and s["median_steps_ratio"] is None
    assert s["sluice_faster_every_seed"] is False
    # over the seeds: a run that stopped short counts as slower than any that reached the bar
    sluice = s["over_seeds"]["sluice"]
    assert sluice == {"runs": 3, "reached": 1, "median_steps": None, "median_time_s": None}
    assert s["over_seeds"]["trl"]["reached"] == 1


def test_a_sluice_run_that_stopped_short_is_never_counted_faster(bench):
    """Sluice stopped at its max steps after 40 s without reaching the bar that TRL reached in
    50 s: Sluice/TRL is at least 0.8, which says nothing about which was faster."""
    runs = [bench_run("trl", 0, 800, 50.0), bench_run("sluice", 0, None, None, ran=(1000, 40.0)),
            bench_run("trl", 1, 400, 40.0), bench_run("sluice", 1, 300, 20.0),
            bench_run("trl", 2, 400, 40.0), bench_run("sluice", 2, 300, 30.0)]  # fmt: skip
    s = bench.summarize(runs, ["copy"], [0, 1, 2])["copy"]
    stopped = s["per_seed"][0]
    assert stopped["censored"] == "at least" and stopped["time_ratio"] == pytest.approx(0.8)
    assert s["sluice_faster_every_seed"] is False
    assert s["median_time_ratio"] == pytest.approx(0.75)  # of 0.5, 0.75 and the unknown (> any)
    assert s["median_steps_ratio"] == pytest.approx(0.75)


def test_the_distribution_over_seeds_counts_a_run_that_stopped_short_as_slowest(bench):
    runs = [bench_run("sluice", 0, 300, 20.0), bench_run("sluice", 1, 500, 30.0),
            bench_run("sluice", 2, None, None, ran=(1000, 60.0)),
            bench_run("trl", 0, 400, 25.0), bench_run("trl", 1, 200, 10.0),
            bench_run("trl", 2, 900, 50.0)]  # fmt: skip
    s = bench.summarize(runs, ["copy"], [0, 1, 2])["copy"]["over_seeds"]
    assert s["sluice"] == {"runs": 3, "reached": 2, "median_steps": 500, "median_time_s": 30.0}
    assert s["trl"] == {"runs": 3, "reached": 3, "median_steps": 400, "median_time_s": 25.0}


def test_repeats_are_rows_against_the_seeds_one_trl_run(bench):
    """Seed 0: TRL 50 s; Sluice 40 s, then a run that stopped short. Seed 1: TRL 40 s; Sluice
    20 s and 30 s. The first pass over the seeds was faster on both, the second was not."""
    runs = [bench_run("trl", 0, 500, 50.0), {**bench_run("sluice", 0, 400, 40.0), "repeat": 0},
            {**bench_run("sluice", 0, None, None, ran=(1000, 60.0)), "repeat": 1},
            bench_run("trl", 1, 400, 40.0), {**bench_run("sluice", 1, 300, 30.0), "repeat": 1},
            {**bench_run("sluice", 1, 200, 20.0), "repeat": 0}]  # fmt: skip
    s = bench.summarize(runs, ["copy"], [0, 1])["copy"]
    assert [(r["seed"], r["repeat"]) for r in s["per_seed"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["trl"]["time_s"] for r in s["per_seed"]] == [50.0, 50.0, 40.0, 40.0]
    assert [r["time_ratio"] for r in s["per_seed"]] == pytest.approx([0.8, 1.2, 0.5, 0.75])
    assert s["per_seed"][1]["censored"] == "at least"
    assert s["faster_every_seed_by_repeat"] == [True, False]
    assert s["sluice_faster_every_seed"] is False
    assert s["median_time_ratio"] == pytest.approx((0.75 + 0.8) / 2)  # 0.5, 0.75, 0.8 and > any
    assert s["over_seeds"]["sluice"]["runs"] == 4 and s["over_seeds"]["sluice"]["reached"] == 3
    assert s["over_seeds"]["trl"] == {"runs": 2, "reached": 2, "median_steps": 450, "median_time_s": 45.0}


def test_ahead_at_every_time_compares_the_shares_of_runs_at_the_threshold(bench):
    """Sluice reached it at 10 s and 20 s and stopped short once (1/3 by 10 s, 2/3 by 20 s); TRL
    at 15 s and 30 s (1/2 by 15 s): at 15 s TRL's share is larger, so Sluice is not ahead at
    every time, though it was faster on both seeds where both reached the bar."""
    sluice = [{**bench_run("sluice", 0, 100, 10.0), "repeat": 0},
              {**bench_run("sluice", 1, 200, 20.0), "repeat": 0},
              {**bench_run("sluice", 0, None, None, ran=(1000, 40.0)), "repeat": 1}]  # fmt: skip
    trl = [bench_run("trl", 0, 150, 15.0), bench_run("trl", 1, 300, 30.0)]
    assert bench.reached_share(sluice, "sluice", 15.0) == pytest.approx(1 / 3)
    assert bench.ahead_at_every_time(sluice + trl) is False
    # the run that stopped short reaches it at 12 s instead: 2/3 by 12 s, then 1 by 20 s
    sluice[2] = {**bench_run("sluice", 0, 120, 12.0), "repeat": 1}
    assert bench.ahead_at_every_time(sluice + trl) is True
    assert bench.summarize(sluice + trl, ["copy"], [0, 1])["copy"]["sluice_ahead_at_every_time"] is True
    assert bench.ahead_at_every_time(sluice) is None  # no TRL runs: no verdict


def test_each_seed_runs_trl_once_and_sluice_repeats_times(bench, monkeypatch, tmp_path):
    calls = []

    def fake_bracketed(run, spec, progress, model_dir, repeats):
        calls.append((spec["seed"], run.__name__, spec["repeat"]))
        assert spec["group"] == 16
        return {"system": run.__name__}

    monkeypatch.setattr(bench, "bracketed", fake_bracketed)
    args = bench.argparse.Namespace(
        tasks=["copy"], seeds=[0, 1], repeats=2, skip_trl=False, max_steps=5, timeout=1.0, budget=9.0,
        sluice_config="c.yaml", sluice_override=[], bound_repeats=1, group=16,
    )  # fmt: skip
    runs = bench.run_all(args, tmp_path, tmp_path, bench.Console(file=io.StringIO()))
    # TRL first on even pairs, last on odd ones; each result is tagged with its repeat
    assert calls == [(0, "run_trl", 0), (0, "run_sluice", 0), (0, "run_sluice", 1),
                     (1, "run_sluice", 1), (1, "run_sluice", 0), (1, "run_trl", 0)]  # fmt: skip
    assert [(r["seed"], r["repeat"]) for r in runs] == [(s, k) for s, _, k in calls]


@pytest.mark.parametrize(
    ("flag", "value", "error"),
    [("--repeats", "0", "--repeats must be at least 1, got 0"),
     ("--repeats", "-1", "--repeats must be at least 1, got -1"),
     ("--max-steps", "0", "--max-steps must be at least 1, got 0"),
     ("--group", "1", "--group must be at least 2 (group advantages need two completions), got 1")],
)  # fmt: skip
def test_a_bad_repeat_or_group_count_is_refused_naming_the_flag(
    bench, monkeypatch, capsys, flag, value, error
):
    monkeypatch.setattr(bench.sys, "argv", ["vs_trl.py", flag, value])
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args()
    assert exit_.value.code == 2
    assert error in capsys.readouterr().err


def test_the_group_sets_both_systems_batch(bench, tmp_path):
    spec = {"task": "copy", "seed": 3, "model_dir": "m", "max_steps": 9, "group": 16}
    overrides = bench.sluice_overrides(spec, tmp_path)
    assert {"rollout.group_size=16", "learner.batch_size=128", "rollout.prompts_per_batch=8"} <= set(
        overrides
    )
    assert {"run.seed=3", "task.name=copy", "learner.total_steps=9", "model.path=m"} <= set(overrides)


def test_without_a_step_cap_only_the_budget_ends_sluice_and_trl_keeps_its_dataset(bench, tmp_path):
    spec = {"task": "copy", "seed": 3, "model_dir": "m", "max_steps": None, "group": 8}
    assert f"learner.total_steps={bench.SLUICE_STEPS}" in bench.sluice_overrides(spec, tmp_path)
    assert bench.SLUICE_STEPS * 0.02 > bench.BUDGET_S * 10  # a 20 ms step could not reach it in 10 budgets
    pytest.importorskip("trl")
    trl_config = bench.grpo_config({**spec, "output_dir": str(tmp_path)})
    assert trl_config.max_steps == 5000  # and its prompt dataset, as every earlier pass had them
    capped = bench.grpo_config({**spec, "max_steps": 9, "output_dir": str(tmp_path)})
    assert capped.max_steps == 9 and "learner.total_steps=9" in bench.sluice_overrides(
        {**spec, "max_steps": 9}, tmp_path
    )


class FakeProc:
    def poll(self):
        return None


class ListTail:
    """Hands out one more batch of records at each poll, as a growing log file would."""

    def __init__(self, batches: list[list[dict]]) -> None:
        self.batches = batches

    def poll(self) -> list[dict]:
        return self.batches.pop(0) if self.batches else []


def watcher(bench, clock, budget_s: float):
    progress = bench.Progress(console=bench.Console(file=io.StringIO()))
    return bench.Watcher(progress, "run", "reward", "step", clock, budget_s)


def test_a_run_past_its_clock_budget_stops_on_each_systems_clock(bench, monkeypatch):
    monkeypatch.setattr(bench.time, "sleep", lambda s: None)
    # TRL: its records carry seconds since on_train_begin
    trl = [[{"step": 1, "time_s": 0.2, "reward": 0.1}], [{"step": 2, "time_s": 9.5, "reward": 0.1}],
           [{"step": 3, "time_s": 10.5, "reward": 0.1}]]  # fmt: skip
    w = watcher(bench, bench.trl_clock, 10.0)
    assert bench.watch(FakeProc(), ListTail(trl), w, timeout_s=60) == "budget (10 s)"
    assert w.rewards == [0.1, 0.1, 0.1]
    # Sluice: epoch times, counted from the start of its first step's wait
    sluice = [[{"step": 1, "time": 1000.5, "step_s": 0.5, "reward": 0.2}],
              [{"step": 2, "time": 1009.9, "step_s": 0.1, "reward": 0.2}],
              [{"step": 3, "time": 1010.1, "step_s": 0.1, "reward": 0.2}]]  # fmt: skip
    w = watcher(bench, bench.sluice_clock, 10.0)
    assert bench.watch(FakeProc(), ListTail(sluice), w, timeout_s=60) == "budget (10 s)"
    assert len(w.rewards) == 3  # 9.9 s at step 2 (inside), 10.1 s at step 3 (past it)


def test_the_threshold_inside_the_budget_stops_first_and_curves_are_cut_at_the_budget(bench, monkeypatch):
    monkeypatch.setattr(bench.time, "sleep", lambda s: None)
    records = [[{"step": i, "time_s": float(i), "reward": 0.95} for i in range(1, 6)]]
    assert (
        bench.watch(FakeProc(), ListTail(records), watcher(bench, bench.trl_clock, 10.0), 60) == "threshold"
    )
    curve = [{"step": i, "time_s": 4.0 * i, "reward": 1.0, "tokens": 1} for i in range(1, 6)]
    assert [c["step"] for c in bench.within_budget(curve, 10.0)] == [1, 2]
    # a crossing past the budget is not a crossing
    assert bench.summarize_curve(bench.within_budget(curve, 10.0))["reached"] is False


def test_version_to_generate_is_from_the_learners_record_to_the_first_generation_on_it(bench):
    steps = [{"version": 1, "time": 10.0}, {"version": 2, "time": 20.0}, {"version": 3, "time": 30.0}]

    def batch(version: int, started: float) -> dict:  # a batch record is written after its PUT
        return {"version": version, "time": started + 0.5, "put_s": 0.1, "score_s": 0.1, "generate_s": 0.3}

    batches = [batch(1, 10.01), batch(1, 10.5), batch(2, 20.03), batch(3, 30.02), batch(9, 99.0)]
    # v1: the first of its two batches; v9 was never recorded (the run ended first)
    assert bench.version_to_generate(steps, batches) == pytest.approx(0.02)
    assert bench.version_to_generate(steps, [batch(9, 99.0)]) is None


def test_against_bound_sets_the_training_threads_cpu_against_training_alone(bench):
    run = {
        "system": "sluice", "task": "copy", "seed": 2, "s_per_step": 0.066,
        "phases": {"learner": {"step_s": 0.065, "compute_cpu_s": 0.052}},
        "bound_s_per_step": 0.050, "bound_train_s": 0.040,
    }  # fmt: skip
    (row,) = bench.against_bound([run, {"system": "trl"}], {"bound_s_per_step": 1.0, "train_s": {"1": 1.0}})
    assert row["median_step_over_bound"] == pytest.approx(1.3)
    assert row["wall_over_bound"] == pytest.approx(1.32)
    assert row["train_cpu_over_alone"] == pytest.approx(1.3)  # the same work ran 30% slower in the run
    del run["bound_train_s"]  # measured once for the whole run instead
    (row,) = bench.against_bound([run], {"bound_s_per_step": 0.05, "train_s": {"1": 0.052}})
    assert row["train_cpu_over_alone"] == pytest.approx(1.0)


def test_cpu_columns_sum_the_services_and_split_the_trainers_main_thread(bench):
    sluice = {
        "cpu_s": {
            "learner": 0.050, "learner:main": 0.045, "rollout-0": 0.020, "rollout-0:main": 0.018,
            "rollout-1": 0.018, "rollout-1:main": 0.016, "buffer-0": 0.003, "buffer-0:main": 0.001,
            "launcher": 0.001, "launcher:main": 0.001,
        },
        "total_s": 0.092,
    }  # fmt: skip
    got = bench.cpu_columns(sluice)
    assert got["trainer main thread"] == 0.045 and got["trainer other threads"] == pytest.approx(0.005)
    assert got["rollouts"] == pytest.approx(0.038) and got["shards"] == 0.003 and got["launcher"] == 0.001
    trl = bench.cpu_columns({"cpu_s": {"trainer": 0.14, "trainer:main": 0.07}, "total_s": 0.14})
    assert trl["trainer main thread"] == 0.07 and trl["trainer other threads"] == pytest.approx(0.07)
    assert trl["rollouts"] is None and trl["shards"] is None and trl["launcher"] is None


def run_quick(tmp_path: Path, *extra: str, timeout_s: float) -> dict:
    run_script(["benchmarks/vs_trl.py", "--quick", "--out", str(tmp_path), *extra], timeout_s, columns=180)
    assert (tmp_path / "vs_trl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads((tmp_path / "vs_trl.json").read_text())


def check_run(run: dict) -> None:
    assert run["task"] == "copy" and run["seed"] == 0 and run["steps"] >= 5
    assert len(run["curve"]) >= 5 and all(0 <= c["reward"] <= 1 for c in run["curve"])
    assert run["startup_s"] > 0 and run["tokens_per_s"] > 0
    assert run["crossings"].keys() == {"0.5", "0.7", "0.9"}
    assert "cpu" in run  # None where the run ended before a window after the warm-up steps


@pytest.mark.slow  # a whole `sluice run` (~35 s)
def test_quick_sluice_and_bound(tmp_path):
    data = run_quick(tmp_path, "--skip-trl", timeout_s=120)
    assert data["workload"]["parameters"] == 344_448
    (run,) = data["runs"]
    assert run["system"] == "sluice"
    check_run(run)
    assert set(run["phases"]["learner"]) == {"compute_s", "compute_cpu_s", "wait_s", "sync_s", "step_s"}
    assert set(run["phases"]["rollout"]) == {"generate_s", "pause_s", "put_s", "version_to_generate_s"}
    assert run["phases"]["rollout"]["version_to_generate_s"] > 0
    bound = data["bound"]
    assert all(bound[k][t] > 0 for k in ("train_s", "generate_s") for t in ("1", "2"))
    assert bound["bound_s_per_step"] == max(bound["train_s"]["1"], bound["generate_s"]["1"])
    (vs_bound,) = data["sluice_vs_bound"]
    assert vs_bound["wall_over_bound"] > 0 and vs_bound["train_cpu_over_alone"] > 0
    # the run is set against the bound measured around it: the mean of before and after
    assert run["bound_before_s"] > 0 and run["bound_after_s"] > 0
    assert vs_bound["bound_s_per_step"] == (run["bound_before_s"] + run["bound_after_s"]) / 2
    # without TRL's runs there is nothing to pair (and scipy is not needed)
    assert data["seed_pairs"]["copy"]["thresholds"]["0.9"]["steps"] == {"seeds": 0}


@pytest.mark.slow
def test_quick_with_trl(tmp_path):
    pytest.importorskip("trl")
    data = run_quick(tmp_path, timeout_s=300)
    assert sorted(r["system"] for r in data["runs"]) == ["sluice", "trl"]
    for run in data["runs"]:
        check_run(run)
    trl = next(r for r in data["runs"] if r["system"] == "trl")
    assert set(trl["phases"]["trainer"]) == {"generate_s", "train_s", "optim_s", "step_s"}
    assert all(v > 0 for v in trl["phases"]["trainer"].values())
    assert data["seed_pairs"]["copy"]["s_per_step_ratio"]["seeds"] == 1
