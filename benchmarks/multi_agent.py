"""Learning in the two shipped multi-agent tasks (docs/multi_agent.md), three seeds each.

relay (cooperative, two policies): each policy's learner batch reward over the first and last
`--window` steps. duel (competitive self-play, one policy against a pool of its past
versions): the learner's reward against the pool, and the win rate against version 0 (the
pool's fixed reference) over the first and last rollout batches that drew it, with the rate of
legal plays. Per run also: the worst staleness of each policy's samples (bound 1) and the
buffer audit (every trained id once, each from its own policy's agent). Sequential (2 cores).

    python benchmarks/multi_agent.py [--seeds 0 1 2] [--relay-steps 600] [--duel-steps 300]
        [--out benchmarks/results/multi_agent]
    python benchmarks/multi_agent.py --quick     # smoke test: 3 steps, one seed

Prints a table and writes <out>/multi_agent.json and <out>/multi_agent.png (reward curves).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from sluice.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
POLICIES = {"relay": {"proposer": "", "solver": "-solver"}, "duel": {"player": ""}}
TRAINED_AGENT = {"proposer": "proposer", "solver": "solver", "player": "first"}


def run_one(task: str, seed: int, steps: int, work: Path) -> dict:
    run_dir = work / f"{task}-s{seed}"
    cmd = [
        sys.executable, "-m", "sluice.cli", "run", str(ROOT / "configs" / "multi_agent" / f"{task}.yaml"),
        f"run.dir={run_dir}", f"run.seed={seed}", f"model.init.seed={seed}", f"rollout.seed={seed}",
        f"learner.total_steps={steps}", "learner.audit_consumed=true", "--no-progress",
    ]  # fmt: skip
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
    if task == "duel":
        run["vs_v0"] = [r["reward/first"] for r in rollouts if r.get("opponent_version/second") == 0]
        run["legal"] = [r["mean/first/legal"] for r in rollouts]
    return run


def mean(xs: list[float], window: int, last: bool) -> float:
    w = min(window, len(xs))
    return statistics.fmean(xs[-w:] if last else xs[:w]) if xs else float("nan")


def summarise(runs: list[dict], window: int) -> tuple[Table, list[dict]]:
    t = Table(title=f"multi-agent learning (start/end: mean of the first/last {window})")
    for col in ("task", "seed", "policy", "reward start", "reward end", "vs v0 start", "vs v0 end",
                "legal end", "staleness max", "audit", "wall s"):  # fmt: skip
        t.add_column(col, justify="left" if col in ("task", "policy") else "right")
    rows = []
    for run in runs:
        for policy, p in run["policies"].items():
            vs_v0, legal = run.get("vs_v0", []), run.get("legal", [])
            row = {
                "task": run["task"], "seed": run["seed"], "policy": policy,
                "reward_start": mean(p["rewards"], window, False),
                "reward_end": mean(p["rewards"], window, True),
                "vs_v0_start": mean(vs_v0, 3, False), "vs_v0_end": mean(vs_v0, 3, True),
                "legal_end": mean(legal, window, True),
                "staleness_max": p["staleness_max"], "audit_ok": p["audit_ok"], "wall_s": run["wall_s"],
            }  # fmt: skip
            rows.append(row)
            cells = [
                f"{row[k]:.3f}"
                for k in ("reward_start", "reward_end", "vs_v0_start", "vs_v0_end", "legal_end")
            ]
            t.add_row(run["task"], str(run["seed"]), policy, *cells, str(row["staleness_max"]),
                      "ok" if row["audit_ok"] else "FAIL", f"{run['wall_s']:.0f}")  # fmt: skip
    return t, rows


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, task in zip(axes, ("relay", "duel")):
        for run in (r for r in runs if r["task"] == task):
            for k, (policy, p) in enumerate(run["policies"].items()):
                ax.plot(
                    p["rewards"],
                    color=f"C{k}",
                    alpha=0.6,
                    label=policy if run["seed"] == runs[0]["seed"] else None,
                )
            if task == "duel" and run.get("vs_v0"):
                ax.plot(*zip(*enumerate(run["vs_v0"])), color="C3", alpha=0.3)
        ax.set_title(f"{task}: learner batch reward per policy and seed")
        ax.set_xlabel("learner step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--relay-steps", type=int, default=600)
    ap.add_argument("--duel-steps", type=int, default=300)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "multi_agent")
    ap.add_argument("--quick", action="store_true", help="3 steps, one seed: a smoke test")
    args = ap.parse_args()
    if args.quick:
        args.seeds, args.relay_steps, args.duel_steps, args.window = [0], 3, 3, 2
    console = Console()
    runs = []
    plan = [(task, seed) for task in ("relay", "duel") for seed in args.seeds]
    with tempfile.TemporaryDirectory() as work, Progress(console=console) as progress:
        bar = progress.add_task("runs", total=len(plan))
        for task, seed in plan:
            progress.update(bar, description=f"{task} seed {seed}")
            steps = args.relay_steps if task == "relay" else args.duel_steps
            runs.append(run_one(task, seed, steps, Path(work)))
            progress.advance(bar)
    t, rows = summarise(runs, args.window)
    console.print(t)
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: getattr(args, k) for k in ("seeds", "relay_steps", "duel_steps", "window")}
    (args.out / "multi_agent.json").write_text(
        json.dumps({"settings": settings, "rows": rows, "runs": runs}, indent=1)
    )
    plot(runs, args.out / "multi_agent.png")
    console.print(f"wrote {args.out / 'multi_agent.json'} and multi_agent.png")


if __name__ == "__main__":
    main()
