"""Pool several vs_trl.py results into one comparison over all their seeds.

A seed is a draw (docs/architecture.md, "Steps to a reward are a distribution over seeds"), and
one vs_trl pass is 16 seeds in ~45 min on two cores. Whether Sluice takes more steps than TRL to
a reward, or wins more seeds than it loses, is a question about many seeds: several passes,
each from its own session. This reads their JSONs, checks that they ran the same workload (the
fields in SAME_WORKLOAD; a result that differs is refused, naming the field and both files),
keeps each seed's first run of each system (`--repeats` runs past the first are left out and
counted; a seed in two files is refused) and reports, per task, over all the seeds:

- vs_trl's own summary (`vs_trl.summarize`) of the pooled runs: the time ratio seed by seed,
  on how many seeds Sluice was faster, the censored medians, and whether Sluice's share of runs
  at the threshold was at least TRL's at every wall time;
- per threshold (0.5, 0.7, 0.9), seed_pairs.py's statistics: the seeds each system reached it on,
  and over the seeds both did, Sluice/TRL in steps and in time (a sign test; the geometric mean
  with a 95% bootstrap interval). The copy task's plateau sits at 0.75, so 0.5 and 0.7 compare
  the climb without its lottery;
- the time per step, Sluice/TRL seed by seed (median and range).

    .venv/bin/python benchmarks/vs_trl_pool.py RESULT [RESULT ...] [--out DIR]

RESULT: a vs_trl.json, or a directory holding one. Writes DIR/vs_trl_pool.json and
DIR/vs_trl_pool.png (per task: the share of seeds each system had brought to each threshold by
steps, and to the stop threshold by wall time) and prints the tables. Exits 2 on a result it
refuses.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vs_trl  # noqa: E402
from seed_pairs import SYSTEMS, first_runs_of, pairs_table  # noqa: E402

COLORS = {"sluice": "tab:blue", "trl": "tab:orange"}
# What a run trained on and how it was judged: results that differ in any of these do not pool.
# Left out on purpose: `max_steps` (since the thirteenth pass the budget ends both systems' runs
# first; before it, a Sluice plateau run could stop at 5,000 steps a few seconds short of the
# budget, which censors it the same way) and `repeats` (only first runs are pooled). A `quick`
# result is refused whatever the others hold.
SAME_WORKLOAD = (
    "model_init", "task_length", "prompts", "group", "batch", "max_new_tokens", "lr", "temperature",
    "stop_at", "window", "thresholds", "budget_s", "sluice_config", "sluice_overrides", "trl_threads",
)  # fmt: skip


class PoolError(ValueError):
    """A result that cannot be pooled; the message names the file and the field."""


def load_results(paths: list[Path]) -> list[tuple[Path, dict]]:
    """Each RESULT argument's vs_trl.json, parsed and checked to be a full vs_trl.py result."""
    out = []
    for given in paths:
        path = given / "vs_trl.json" if given.is_dir() else given
        if not path.is_file():
            raise PoolError(f"{given}: no vs_trl.json there")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise PoolError(f"{path}: not JSON ({e})") from None
        missing = [k for k in ("workload", "runs") if k not in (data if isinstance(data, dict) else {})]
        if missing:
            raise PoolError(f"{path}: not a vs_trl.py result (no {missing[0]!r})")
        if data["workload"].get("quick"):
            raise PoolError(f"{path}: workload.quick is set: a smoke run, not a measurement")
        out.append((path, data))
    return out


def check_same_workload(results: list[tuple[Path, dict]]) -> None:
    """Refuse results whose workloads differ in a field of SAME_WORKLOAD."""
    (first_path, first), *rest = results
    for path, data in rest:
        for key in SAME_WORKLOAD:
            a, b = first["workload"].get(key), data["workload"].get(key)
            if a != b:
                raise PoolError(f"workload.{key} differs: {a!r} in {first_path}, {b!r} in {path}")


def first_runs(results: list[tuple[Path, dict]]) -> tuple[list[dict], int]:
    """Every seed's first run of each system over all the results, and how many later repeats
    were left out (a seed's repeats are draws of one seed, not more seeds)."""
    runs: list[dict] = []
    seen: dict[tuple, Path] = {}
    left_out = 0
    for path, data in results:
        firsts = first_runs_of(data["runs"])
        left_out += len(data["runs"]) - len(firsts)
        for r in firsts:
            key = (r["task"], r["seed"], r["system"])
            if key in seen:
                raise PoolError(
                    f"seed {r['seed']} ({r['task']}, {r['system']}) is in both {seen[key]} and {path}"
                )
            seen[key] = path
            runs.append(r)
    return runs, left_out


def pool_task(runs: list[dict], task: str, thresholds: list[float]) -> dict:
    """Everything the module docstring lists, for one task's pooled runs."""
    mine = [r for r in runs if r["task"] == task]
    seeds = sorted({r["seed"] for r in mine})
    summary = vs_trl.summarize(mine, [task], seeds)[task]
    return {
        "seeds": seeds,
        **vs_trl.faster_counts(summary["per_seed"]),
        "summary": summary,
        **vs_trl.seed_pairs(mine, [task], thresholds)[task],
    }


def pool(results: list[tuple[Path, dict]]) -> dict:
    """The pooled comparison of checked results (check_same_workload first)."""
    runs, left_out = first_runs(results)
    workload = results[0][1]["workload"]
    tasks = sorted({r["task"] for r in runs})
    return {
        "workload": {k: workload.get(k) for k in SAME_WORKLOAD},
        "sources": [
            {
                "path": str(path),
                "seeds": sorted({r["seed"] for r in data["runs"]}),
                "max_steps": data["workload"].get("max_steps"),
            }
            for path, data in results
        ],
        "repeats_left_out": left_out,
        "tasks": {task: pool_task(runs, task, workload["thresholds"]) for task in tasks},
        "runs": runs,
    }


# -- report ------------------------------------------------------------------------------------


def task_table(task: str, pooled: dict) -> Table:
    n = len(pooled["seeds"])
    table = pairs_table(
        f"{task}: Sluice / TRL over {n} seeds (each system's first run of each)", pooled["thresholds"]
    )
    s, step = pooled["summary"], pooled["s_per_step_ratio"]
    table.add_section()
    table.add_row("time ratio", f"median {vs_trl.fmt(s['median_time_ratio'], '.2f')}", "", "", "")
    table.add_row(
        "faster on", f"Sluice {pooled['sluice_faster_on']}, TRL {pooled['trl_faster_on']}",
        f"neither reached: {pooled['neither_reached']}", "", "",
    )  # fmt: skip
    ahead = {True: "yes", False: "no", None: "-"}[s["sluice_ahead_at_every_time"]]
    table.add_row(f"share at {vs_trl.STOP_AT}", f"Sluice >= TRL always: {ahead}", "", "", "")
    if step["seeds"]:
        span = f"median {step['median']:.2f} ({step['min']:.2f}-{step['max']:.2f})"
        table.add_row("s / step", span, "", "", "")
    return table


def plot(result: dict, path: Path) -> None:
    """Per task: the share of seeds at each threshold by steps (top), at the stop threshold by
    wall time (bottom, vs_trl's panel)."""
    from matplotlib.figure import Figure

    tasks = list(result["tasks"])
    fig = Figure(figsize=(6 * len(tasks), 8), layout="constrained")
    axes = fig.subplots(2, len(tasks), squeeze=False)
    styles = ["--", ":", "-"]
    for col, task in enumerate(tasks):
        pooled, ax = result["tasks"][task], axes[0][col]
        for (thr, t), ls in zip(pooled["thresholds"].items(), styles):
            for system in SYSTEMS:
                steps = sorted(
                    c["step"] for r in result["runs"]
                    if r["task"] == task and r["system"] == system and (c := r["crossings"].get(thr))
                )  # fmt: skip
                n = t["runs"][system]
                if n:
                    ys = [i / n for i in range(len(steps) + 1)]
                    label = f"{system} to {thr}: {len(steps)} of {n}"
                    ax.step([0, *steps], ys, where="post", color=COLORS[system], ls=ls, label=label)
        ax.set(xlabel="step (optimizer updates)", ylabel="share of seeds at the threshold", ylim=(0, 1.02))
        ax.set_title(f"{task}: {len(pooled['seeds'])} seeds pooled")
        ax.legend(fontsize=7)
        vs_trl.plot_reached_by_time(axes[1][col], [r for r in result["runs"] if r["task"] == task], COLORS)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, nargs="+", help="vs_trl.json files or directories holding one")
    p.add_argument("--out", type=Path, default=vs_trl.ROOT / "benchmarks" / "results" / "vs_trl_pool")
    args = p.parse_args()
    console = Console(width=200)
    try:
        results = load_results(args.results)
        check_same_workload(results)
        result = pool(results)
    except PoolError as e:
        console.print(f"[red]{e}")
        sys.exit(2)
    for task, pooled in result["tasks"].items():
        console.print(task_table(task, pooled))
    console.print(f"{result['repeats_left_out']} later repeats left out")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vs_trl_pool.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "vs_trl_pool.png")
    console.print(f"wrote {args.out / 'vs_trl_pool.json'} and {args.out / 'vs_trl_pool.png'}")


if __name__ == "__main__":
    main()
