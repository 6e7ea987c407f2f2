"""Learning in the two shipped multi-agent tasks (docs/multi_agent.md), three seeds each.

propose_solve (cooperative, two policies): each policy's learner batch reward over the first
and last `--window` steps, and at the end the rate of valid problems and of exact answers.
duel (competitive self-play, one policy against a pool of its past versions): the learner's
reward against the pool, the win rate against version 0 (the pool's fixed reference) over the
first and last rollout batches that drew it, and the rate of legal plays. Per run also: the
worst staleness of each policy's samples (bound 1) and the buffer audit (every trained id
once, each from its own policy's agent). Sequential (2 cores).

    python benchmarks/multi_agent.py [--seeds 0 1 2] [--propose-solve-steps 800] [--duel-steps 300]
        [--out benchmarks/results/multi_agent]
    python benchmarks/multi_agent.py --quick     # smoke test: 3 steps, one seed

Prints a table and writes <out>/multi_agent.json and <out>/multi_agent.png (reward curves).
"""

from __future__ import annotations

import argparse
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
POLICIES = {"propose_solve": {"proposer": "", "solver": "-solver"}, "duel": {"player": ""}}
TRAINED_AGENT = {"proposer": "proposer", "solver": "solver", "player": "first"}
INFO = {"propose_solve": ["mean/solver/valid", "mean/solver/exact"], "duel": ["mean/first/legal"]}


def run_one(task: str, seed: int, steps: int, work: Path) -> dict:
    run_dir = work / f"{task}-s{seed}"
    cmd = sluice_run_cmd(
        ROOT / "configs" / "multi_agent" / f"{task}.yaml",
        f"run.dir={run_dir}", f"run.seed={seed}", f"model.init.seed={seed}", f"rollout.seed={seed}",
        f"learner.total_steps={steps}", "learner.audit_consumed=true",
    )  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=3600)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{task} seed {seed} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    metrics = run_dir / "metrics"
    run = {"task": task, "seed": seed, "wall_s": wall, "policies": {}}
    for policy, suffix in POLICIES[task].items():
        steps_log = read_jsonl(metrics / f"learner{suffix}.jsonl")
        ids = [i for r in read_jsonl(metrics / f"consumed{suffix}.jsonl") for i in r["trained"]]
        run["policies"][policy] = {
            "rewards": [s["reward_mean"] for s in steps_log],
            "staleness_max": max(s["staleness_max"] for s in steps_log),
            "trained": len(ids),
            "audit_ok": len(ids) == len(set(ids)) == sum(s["samples"] for s in steps_log)
            and all(f"/{TRAINED_AGENT[policy]}/" in i for i in ids),
        }
    rollouts = read_jsonl(metrics / "rollout-0.jsonl")
    run["info"] = {k: [r[k] for r in rollouts] for k in INFO[task]}
    if task == "duel":
        against_v0 = [r for r in rollouts if r.get("opponent_version/second") == 0]
        run["vs_v0"] = [r["reward/first"] for r in against_v0]
        run["vs_v0_versions"] = [r["version"] for r in against_v0]
    return run


def mean(xs: list[float], window: int, last: bool) -> float:
    w = min(window, len(xs))
    return statistics.fmean(xs[-w:] if last else xs[:w]) if xs else float("nan")


def summarise(runs: list[dict], window: int) -> tuple[Table, list[dict]]:
    t = Table(title=f"multi-agent learning (start/end: mean of the first/last {window})")
    for col in ("task", "seed", "policy", "reward start", "reward end", "vs v0 start", "vs v0 end",
                "at the end", "staleness max", "audit", "wall s"):  # fmt: skip
        t.add_column(col, justify="left" if col in ("task", "policy") else "right")
    rows = []
    for run in runs:
        for policy, p in run["policies"].items():
            vs_v0 = run.get("vs_v0", [])
            row = {
                "task": run["task"], "seed": run["seed"], "policy": policy,
                "reward_start": mean(p["rewards"], window, False),
                "reward_end": mean(p["rewards"], window, True),
                "vs_v0_start": mean(vs_v0, 3, False), "vs_v0_end": mean(vs_v0, 3, True),
                "info_end": {k.rsplit("/", 1)[1]: mean(v, window, True) for k, v in run["info"].items()},
                "staleness_max": p["staleness_max"], "audit_ok": p["audit_ok"], "wall_s": run["wall_s"],
            }  # fmt: skip
            rows.append(row)
            cells = [f"{row[k]:.3f}" for k in ("reward_start", "reward_end", "vs_v0_start", "vs_v0_end")]
            cells.append(", ".join(f"{k} {v:.2f}" for k, v in row["info_end"].items()))
            t.add_row(run["task"], str(run["seed"]), policy, *cells, str(row["staleness_max"]),
                      "ok" if row["audit_ok"] else "FAIL", f"{run['wall_s']:.0f}")  # fmt: skip
    return t, rows


def plot(runs: list[dict], path: Path) -> None:
    with figure(path, ncols=2, size=(12, 4.5)) as axes:
        for ax, task in zip(axes, ("propose_solve", "duel")):
            for run in (r for r in runs if r["task"] == task):
                first = run["seed"] == runs[0]["seed"]
                for k, (policy, p) in enumerate(run["policies"].items()):
                    ax.plot(p["rewards"], color=f"C{k}", alpha=0.6, label=policy if first else None)
                if run.get("vs_v0"):
                    label = "win rate vs version 0 (rollout batches)" if first else None
                    ax.plot(run["vs_v0_versions"], run["vs_v0"], color="C3", alpha=0.3, label=label)
            ax.set_title(f"{task}: learner batch reward per policy and seed")
            ax.set_xlabel("learner step (policy version)")
            ax.legend()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--propose-solve-steps", type=int, default=800)
    ap.add_argument("--duel-steps", type=int, default=300)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "multi_agent")
    ap.add_argument("--quick", action="store_true", help="3 steps, one seed: a smoke test")
    args = ap.parse_args()
    if args.quick:
        args.seeds, args.propose_solve_steps, args.duel_steps, args.window = [0], 3, 3, 2
    console = Console()
    plan = [(task, seed) for task in ("propose_solve", "duel") for seed in args.seeds]
    steps = {"propose_solve": args.propose_solve_steps, "duel": args.duel_steps}
    runs = run_in_turn(
        console, [(f"{task} seed {seed}", partial(run_one, task, seed, steps[task])) for task, seed in plan]
    )
    t, rows = summarise(runs, args.window)
    console.print(t)
    settings = {k: getattr(args, k) for k in ("seeds", "propose_solve_steps", "duel_steps", "window")}
    payload = {"settings": settings, "rows": rows, "runs": runs}
    write_report(console, args.out, "multi_agent", payload, partial(plot, runs))


if __name__ == "__main__":
    main()
