"""benchmarks/vs_trl_pool.py and the seed-by-seed statistics it shares with vs_trl.py
(benchmarks/seed_pairs.py): pooled ratios and tests against hand-computed numbers, and the
results it refuses (another workload, a seed twice, a smoke run, a file that is not a result)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.bench_scripts import ROOT, run_script

pytest.importorskip("scipy")  # the benchmark extra, as vs_trl.py's TRL (scripts/setup_bench.sh)

WORKLOAD = {
    "model_init": {"arch": "llama"}, "task_length": 3, "prompts": 8, "group": 8, "batch": 64,
    "max_new_tokens": 12, "lr": 3e-4, "temperature": 1.0, "stop_at": 0.9, "window": 5,
    "thresholds": [0.5, 0.7, 0.9], "budget_s": 180.0, "sluice_config": "configs/quickstart.yaml",
    "sluice_overrides": [], "trl_threads": 2, "quick": False, "max_steps": 5000,
}  # fmt: skip
S_PER_STEP = {"sluice": 0.05, "trl": 0.1}


@pytest.fixture
def pool_mod(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import vs_trl_pool

    return vs_trl_pool


def run(system: str, seed: int, steps: dict[str, int | None], repeat: int = 0) -> dict:
    """A vs_trl run record: the step at which each threshold was reached (None: not reached;
    a run that did not reach 0.9 ran 3,000 steps to the 180 s budget)."""
    dt = S_PER_STEP[system]
    cross = {thr: {"step": n, "time_s": n * dt} if n else None for thr, n in steps.items()}
    last = (steps["0.9"], steps["0.9"] * dt) if steps["0.9"] else (3000, 180.0)
    return {"task": "copy", "seed": seed, "repeat": repeat, "system": system, "crossings": cross,
            "s_per_step": dt, "curve": [{"step": last[0], "time_s": last[1]}]}  # fmt: skip


# seed: (Sluice's, TRL's) steps to 0.5, 0.7, 0.9
STEPS = {
    1: ((60, 60), (90, 80), (200, 100)),
    2: ((60, 60), (90, 80), (50, 100)),
    3: ((60, 60), (90, 80), (100, 100)),
    4: ((60, 60), (90, 80), (400, 100)),
    5: ((60, 60), (90, 80), (None, 100)),  # Sluice at the plateau for the budget
}


def seed_runs(seed: int, repeat: int = 0) -> list[dict]:
    return [
        run(system, seed, {thr: pair[i] for thr, pair in zip(("0.5", "0.7", "0.9"), STEPS[seed])}, repeat)
        for i, system in enumerate(("sluice", "trl"))
    ]


def write_result(path: Path, runs: list[dict], **workload) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "vs_trl.json").write_text(json.dumps({"workload": {**WORKLOAD, **workload}, "runs": runs}))
    return path


def two_passes(tmp_path: Path) -> list[Path]:
    first = write_result(tmp_path / "a", [r for s in (1, 2, 3, 4) for r in seed_runs(s)])
    return [first, write_result(tmp_path / "b", seed_runs(5), max_steps={"trl": 5000, "sluice": 100000})]


def test_pooled_ratios_against_hand_computed_numbers(pool_mod, tmp_path):
    results = pool_mod.load_results(two_passes(tmp_path))
    pool_mod.check_same_workload(results)  # max_steps may differ
    copy = pool_mod.pool(results)["tasks"]["copy"]
    assert copy["seeds"] == [1, 2, 3, 4, 5]
    stop = copy["thresholds"]["0.9"]
    assert stop["reached"] == {"sluice": 4, "trl": 5} and stop["median_steps"] == {"sluice": 150, "trl": 100}
    steps = stop["steps"]  # ratios 2, 0.5, 1, 4 over the four seeds both reached
    assert (steps["seeds"], steps["sluice_more"], steps["sluice_fewer"]) == (4, 2, 1)
    assert steps["geomean_ratio"] == pytest.approx(math.sqrt(2)) and steps["median_ratio"] == pytest.approx(
        math.sqrt(2)
    )
    assert steps["sign_p"] == pytest.approx(1.0)  # 2 of 3 decided: as even as a sign test gets
    low, high = steps["geomean_95"]
    assert low < math.sqrt(2) < high
    assert stop["time"]["geomean_ratio"] == pytest.approx(math.sqrt(2) / 2)  # half TRL's time a step
    climb = copy["thresholds"]["0.7"]["steps"]  # 90 against 80 on all five
    assert climb["sluice_more"] == 5 and climb["sign_p"] == pytest.approx(2 / 32)
    even = copy["thresholds"]["0.5"]["steps"]  # all ties: no sign test, no interval
    assert even["sign_p"] is None and even["geomean_95"] is None and even["geomean_ratio"] == 1.0
    # time at 0.9: 1.0 (a tie), 0.25, 0.5, 2.0, and seed 5 only TRL reached
    assert (copy["sluice_faster_on"], copy["trl_faster_on"], copy["neither_reached"]) == (2, 2, 0)
    assert copy["s_per_step_ratio"]["median"] == pytest.approx(0.5)


def test_repeats_past_the_first_are_left_out_and_counted(pool_mod, tmp_path):
    result = write_result(tmp_path / "a", seed_runs(1) + [seed_runs(1, repeat=1)[0]] + seed_runs(2))
    pooled = pool_mod.pool(pool_mod.load_results([result]))
    assert pooled["repeats_left_out"] == 1 and len(pooled["runs"]) == 4


def test_seed_pairs_take_each_seeds_first_run(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import seed_pairs

    later = run("sluice", 1, {"0.5": 10, "0.7": 10, "0.9": 10}, repeat=1)  # a lucky repeat, left out
    stop = seed_pairs.by_threshold([later, *seed_runs(1)], [0.9])["0.9"]
    assert stop["runs"] == {"sluice": 1, "trl": 1} and stop["steps"]["geomean_ratio"] == 2.0
    assert seed_pairs.paired([]) == {"seeds": 0}


def test_another_workload_is_refused_naming_the_field_and_both_files(pool_mod, tmp_path):
    first = write_result(tmp_path / "a", seed_runs(1))
    other = write_result(tmp_path / "b", seed_runs(2), sluice_overrides=["learner.max_staleness=0"])
    with pytest.raises(pool_mod.PoolError, match=r"workload\.sluice_overrides differs") as err:
        pool_mod.check_same_workload(pool_mod.load_results([first, other]))
    assert str(first / "vs_trl.json") in str(err.value) and str(other / "vs_trl.json") in str(err.value)


def test_a_seed_in_two_results_is_refused(pool_mod, tmp_path):
    results = pool_mod.load_results([write_result(tmp_path / d, seed_runs(3)) for d in ("a", "b")])
    with pytest.raises(pool_mod.PoolError, match="seed 3 .* is in both"):
        pool_mod.pool(results)


def test_what_is_not_a_measurement_is_refused(pool_mod, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"runs": []}))
    quick = write_result(tmp_path / "q", seed_runs(1), quick=True)
    for given, message in (
        (tmp_path / "empty", "no vs_trl.json there"),
        (tmp_path / "bad.json", "not JSON"),
        (tmp_path / "other.json", "not a vs_trl.py result .no 'workload'"),
        (quick, "workload.quick is set"),
    ):
        with pytest.raises(pool_mod.PoolError, match=message):
            pool_mod.load_results([given])


def test_the_command_writes_its_json_and_png_and_exits_2_on_a_refusal(tmp_path):
    out = tmp_path / "out"
    proc = run_script(["benchmarks/vs_trl_pool.py", *map(str, two_passes(tmp_path)), "--out", str(out)])
    assert "Sluice 2, TRL 2" in proc.stdout and "Sluice >= TRL always: no" in proc.stdout
    written = json.loads((out / "vs_trl_pool.json").read_text())
    assert written["tasks"]["copy"]["seeds"] == [1, 2, 3, 4, 5] and len(written["sources"]) == 2
    assert (out / "vs_trl_pool.png").stat().st_size > 10_000
    other = write_result(tmp_path / "c", seed_runs(1), group=16)
    refused = subprocess.run(
        [sys.executable, "benchmarks/vs_trl_pool.py", str(tmp_path / "a"), str(other), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode == 2 and "workload.group differs" in refused.stdout
