"""DAPO's dynamic sampling under a staleness bound: seconds per learner step with and without
oversampling (`workflow.rollout: [{stage: drop_zero_variance, oversample: X}]`), one run.

The workload is where a generate call costs about the same for 1 group as for 10, as GPU decode
does: sim rollout services (a latency model, sleeps) feeding the stand-in learner
(`sluice.testing.drain`, which sleeps `--step-s` per step instead of training) at
`learner.max_staleness: 1`, two services, 8 prompts x 8 completions, 12 tokens. The task is a
10-row dataset whose rows 0 and 1 always score 1.0 (every such group is zero-variance and
dropped) and whose other rows score at random (kept): DAPO's filter keeps 80% of the groups.
Without oversampling a call that came up short leaves the rest of its grant to another whole
call; with it a service generates the grant over the share it has been keeping, plus one.

Each setting runs `--repeats` times, alternating with the others (the VM drifts). Per run:
seconds per learner step over `--steps` steps after a warm-up, generate calls, groups dropped
and surplus groups (kept beyond the grant, discarded) per step; the speed-up is against the
first setting. The ideal is the step itself or one full call's latency, whichever is longer: at
`max_staleness: 1` a batch is generated on the weights published one step before it is
trained, and one grant here is a whole batch (8 prompts x 8, as in vs_trl), so one call has to
fit in a step; the other service's call is for the next version.

    python benchmarks/dynamic_sampling.py [--oversample 1 1.5 2 3] [--repeats 3] [--steps 100]
    python benchmarks/dynamic_sampling.py --quick       # smoke test: not a measurement

Prints a table and writes <out>/dynamic_sampling.json and .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from common import figure, write_report
from rich.console import Console
from rich.table import Table
from sim_cluster import Cluster, sim_tree

from sluice.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
console = Console()
SIM = {"call_s": 0.005, "decode_step_s": 0.003, "decode_s_per_seq": 0.00002, "eos_prob": 0.0}
ROLLOUT = {"services": 2, "prompts_per_batch": 8, "group_size": 8, "max_new_tokens": 12}
ROWS, UNIFORM_ROWS = 10, "01"  # rows whose groups always score 1.0 (dropped)
REWARD = f"""import random
def some_solved(prompt, completion, reference):
    return 1.0 if reference in {UNIFORM_ROWS!r} else random.random()
"""


def workload(work: Path, oversample: float) -> dict:
    """The run config: the dataset and reward written into `work`."""
    data, reward = work / "rows.jsonl", work / "reward.py"
    data.write_text("".join(json.dumps({"prompt": f"{d} =", "answer": str(d)}) + "\n" for d in range(ROWS)))
    reward.write_text(REWARD)
    return sim_tree(
        SIM,
        ROLLOUT,
        task={"name": "dataset", "params": {"path": str(data)}, "rewards": [{"fn": f"{reward}:some_solved"}]},
        learner={"batch_size": ROLLOUT["prompts_per_batch"] * ROLLOUT["group_size"], "max_staleness": 1},
        workflow={
            "rollout": [{"stage": "drop_zero_variance", "oversample": oversample}],
            "learner": [{"stage": "group_advantages"}, {"stage": "policy_loss"}],
        },
    )


def wait_for_version(cluster: Cluster, version: int, timeout_s: float) -> dict:
    """The drain's timeline record at which the learner reached `version`."""
    deadline = time.monotonic() + timeout_s
    while True:
        cluster.check_alive()
        records = cluster.timeline_records()
        if records and records[-1]["version"] >= version:
            return next(r for r in records if r["version"] >= version)
        if time.monotonic() > deadline:
            raise TimeoutError(f"the learner did not reach v{version} in {timeout_s:.0f} s")
        time.sleep(0.1)


def one_run(work: Path, oversample: float, step_s: float, warmup: int, steps: int) -> dict:
    cluster = Cluster(work, workload(work, oversample), drain_step_s=step_s)
    try:
        cluster.start_core()
        cluster.grow_to(ROLLOUT["services"])
        first = wait_for_version(cluster, warmup, 120)
        last = wait_for_version(cluster, warmup + steps, 60 + 2 * steps * step_s * 10)
    finally:
        cluster.close()
    calls = [
        r
        for i in range(ROLLOUT["services"])
        for r in read_jsonl(cluster.cfg.run_dir / "metrics" / f"rollout-{i}.jsonl")
        if warmup <= r["version"] < warmup + steps
    ]
    return {
        "oversample": oversample,
        "s_per_step": (last["time"] - first["time"]) / (last["version"] - first["version"]),
        "calls_per_step": len(calls) / steps,
        "dropped_per_step": sum(r["dropped_groups"] for r in calls) / steps,
        "surplus_per_step": sum(r["surplus_groups"] for r in calls) / steps,
        "generate_s_per_call": statistics.median(r["generate_s"] for r in calls) if calls else None,
    }


def summarize(runs: list[dict], settings: list[float], step_s: float) -> list[dict]:
    """Medians per setting, and each against the first setting's (the baseline)."""
    call = ROLLOUT["prompts_per_batch"] * ROLLOUT["group_size"]  # samples a full grant generates: a batch
    call_s = SIM["call_s"] + ROLLOUT["max_new_tokens"] * (
        SIM["decode_step_s"] + SIM["decode_s_per_seq"] * call
    )
    ideal = max(step_s, call_s)
    rows = []
    for x in settings:
        mine = [r for r in runs if r["oversample"] == x]
        row = {k: statistics.median(r[k] for r in mine) for k in mine[0] if k != "oversample"}
        rows.append({"oversample": x, **row, "ideal_s_per_step": ideal})
    for row in rows:
        row["speedup_vs_baseline"] = rows[0]["s_per_step"] / row["s_per_step"]
    return rows


def table(rows: list[dict]) -> Table:
    t = Table(title="DAPO filter keeping 80%, sim services, max_staleness 1: per learner step")
    for col in ("oversample", "s/step", "speed-up", "ideal s", "calls", "dropped", "surplus"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            f"{r['oversample']:g}", f"{r['s_per_step']:.4f}", f"{r['speedup_vs_baseline']:.2f}x",
            f"{r['ideal_s_per_step']:.4f}", f"{r['calls_per_step']:.2f}", f"{r['dropped_per_step']:.2f}",
            f"{r['surplus_per_step']:.2f}",
        )  # fmt: skip
    return t


def plot(runs: list[dict], rows: list[dict], path: Path) -> None:
    with figure(path, ncols=2, size=(10, 4)) as (ax, calls_ax):
        xs = [r["oversample"] for r in rows]
        ax.bar([str(x) for x in xs], [r["s_per_step"] for r in rows], color="tab:blue", label="median")
        for r in runs:
            ax.plot(str(r["oversample"]), r["s_per_step"], "k.", alpha=0.6)
        ax.axhline(rows[0]["ideal_s_per_step"], color="tab:green", ls="--", label="ideal max(gen, train)")
        ax.set(xlabel="oversample", ylabel="s per learner step", title="learner step")
        ax.legend()
        calls_ax.bar([str(x) for x in xs], [r["calls_per_step"] for r in rows], color="tab:orange")
        calls_ax.set(xlabel="oversample", ylabel="generate calls per step", title="calls (2 services)")


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--oversample", type=float, nargs="+", default=[1.0, 1.5, 2.0, 3.0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=100, help="learner steps measured per run")
    p.add_argument("--warmup", type=int, default=10, help="learner steps left out first")
    p.add_argument("--step-s", type=float, default=0.05, help="the stand-in learner's step (training)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "dynamic_sampling")
    p.add_argument("--quick", action="store_true", help="a smoke test: short runs, not a measurement")
    args = p.parse_args()
    if min(args.oversample) < 1.0:
        p.error(f"--oversample values must be at least 1, got {args.oversample}")
    if args.quick:
        args.oversample, args.repeats, args.steps, args.warmup = [1.0, 2.0], 1, 8, 3
    runs = []
    with tempfile.TemporaryDirectory(prefix="sluice-dapo-") as tmp:
        for repeat in range(args.repeats):
            for x in args.oversample:
                work = Path(tmp) / f"r{repeat}-os{x:g}"
                work.mkdir()
                console.print(f"repeat {repeat + 1}/{args.repeats}: oversample {x:g} ...")
                runs.append(one_run(work, x, args.step_s, args.warmup, args.steps))
    rows = summarize(runs, args.oversample, args.step_s)
    console.print(table(rows))
    payload = {"sim": SIM, "rollout": ROLLOUT, "step_s": args.step_s, "steps": args.steps, "rows": rows,
               "runs": runs, "quick": args.quick}  # fmt: skip
    write_report(console, args.out, "dynamic_sampling", payload, lambda path: plot(runs, rows, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
