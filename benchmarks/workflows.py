"""Learning with each shipped LLM workflow on the quickstart, in one run: the same config, seed
and step budget, only `workflow=` changes (docs/workflows.md).

Per workflow and seed: the batch reward over the first and the last `--window` learner steps,
the first step whose `--window`-step moving average reaches `--threshold`, and the wall time.
The baseline is grpo measured in the same run: `steps_vs_grpo` is the median steps-to-threshold
of a workflow over grpo's (below 1: fewer steps). Runs are sequential (2 cores).

    python benchmarks/workflows.py [--steps 150] [--seeds 0 1 2] [--workflows grpo rloo ...]
        [--out benchmarks/results/workflows]
    python benchmarks/workflows.py --quick     # smoke test: 3 steps, one seed, not a measurement

Prints a table and writes <out>/workflows.json and <out>/workflows.png (reward curves).
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import time
from functools import partial
from pathlib import Path

from common import figure, run_in_turn, sluice_run_cmd, write_report
from rich.console import Console
from rich.table import Table

from sluice.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
LLM_WORKFLOWS = ["grpo", "dapo", "dr_grpo", "rloo", "reinforce_pp", "gspo", "decoupled_ppo", "ppo_critic"]


def run_one(workflow: str, seed: int, steps: int, work: Path) -> dict:
    run_dir = work / f"{workflow}-s{seed}"
    cmd = sluice_run_cmd(
        ROOT / "configs" / "quickstart.yaml",
        f"run.dir={run_dir}", "rollout.engine=hf", f"run.seed={seed}", f"model.init.seed={seed}",
        f"workflow={workflow}", f"learner.total_steps={steps}",
    )  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{workflow} seed {seed} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    rewards = [r["reward_mean"] for r in read_jsonl(run_dir / "metrics" / "learner.jsonl")]
    return {"workflow": workflow, "seed": seed, "wall_s": wall, "rewards": rewards}


def summarise(run: dict, window: int, threshold: float) -> dict:
    r = run["rewards"]
    w = min(window, len(r))
    moving = [statistics.fmean(r[max(0, i - w + 1) : i + 1]) for i in range(len(r))]
    reached = next((i + 1 for i, m in enumerate(moving) if i + 1 >= w and m >= threshold), None)
    return {
        "start": statistics.fmean(r[:w]),
        "end": statistics.fmean(r[-w:]),
        "steps_to_threshold": reached,
        "wall_s": run["wall_s"],
    }


def table(results: dict[str, list[dict]], steps: int) -> tuple[Table, dict]:
    rows: dict[str, dict] = {}

    def median_steps(name: str) -> float | None:
        """Median steps to the threshold; a seed that never reached it counts as beyond the
        budget (None when most seeds never did)."""
        med = statistics.median(s["steps_to_threshold"] or math.inf for s in results[name])
        return None if math.isinf(med) else med

    base = median_steps("grpo") if "grpo" in results else None
    t = Table(title="quickstart reward by workflow (start/end: mean of the first/last window)")
    for col in ("workflow", "start", "end", "steps to threshold", "vs grpo", "wall s"):
        t.add_column(col, justify="right" if col != "workflow" else "left")
    for name, runs in results.items():
        med = median_steps(name)
        row = {
            "start": [round(s["start"], 3) for s in runs],
            "end": [round(s["end"], 3) for s in runs],
            "steps_to_threshold": [s["steps_to_threshold"] for s in runs],
            "steps_vs_grpo": None if base is None or med is None else med / base,
            "wall_s": [round(s["wall_s"], 1) for s in runs],
        }
        rows[name] = row
        ratio = "" if row["steps_vs_grpo"] is None else f"{row['steps_vs_grpo']:.2f}"
        t.add_row(name, *(", ".join(map(str, row[k])) for k in ("start", "end", "steps_to_threshold")),
                  ratio, ", ".join(map(str, row["wall_s"])))  # fmt: skip
    return t, rows


def plot(runs: list[dict], path: Path) -> None:
    with figure(path) as (ax,):
        colours = {w: f"C{i}" for i, w in enumerate(dict.fromkeys(r["workflow"] for r in runs))}
        for r in runs:
            label = r["workflow"] if r["seed"] == min(x["seed"] for x in runs) else None
            steps = range(1, len(r["rewards"]) + 1)
            ax.plot(steps, r["rewards"], color=colours[r["workflow"]], alpha=0.7, label=label)
        ax.set_xlabel("learner step")
        ax.set_ylabel("batch reward")
        ax.set_title("quickstart (copy 3 digits), one line per workflow and seed")
        ax.legend()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--workflows", nargs="+", default=LLM_WORKFLOWS)
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--threshold", type=float, default=0.8)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "workflows")
    ap.add_argument("--quick", action="store_true", help="3 steps, one seed: a smoke test")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.seeds, args.window = 3, [0], 2
    console = Console()
    plan = [(name, seed) for name in args.workflows for seed in args.seeds]
    runs = run_in_turn(
        console, [(f"{name} seed {seed}", partial(run_one, name, seed, args.steps)) for name, seed in plan]
    )
    results: dict[str, list[dict]] = {}
    for r in runs:
        results.setdefault(r["workflow"], []).append(summarise(r, args.window, args.threshold))
    t, rows = table(results, args.steps)
    console.print(t)
    meta = {k: getattr(args, k) for k in ("steps", "seeds", "window", "threshold")}
    payload = {"settings": meta, "workflows": rows, "runs": runs}
    write_report(console, args.out, "workflows", payload, partial(plot, runs))


if __name__ == "__main__":
    main()
