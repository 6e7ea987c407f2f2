"""Learner throughput and data-wait fraction at max_staleness 0, 1, 2, 4 on the same workload,
in one run.

Each setting is a full `sluice run` (buffer, rollout services, learner, weight sync as real
processes) of the same config, seed and number of steps; only `learner.max_staleness`
changes. Measured on the learner after `--warmup` steps: trajectories trained per second
(wall clock between the metrics lines), tokens (or env steps) per second, and the share of the
step spent waiting for data (sum of wait_s / sum of step_s). max_staleness 0 (synchronous:
rollouts wait for every new version) is the baseline; the speed-up of the others is against it.
On a shared machine the load drifts between runs: `--repeats R` runs the settings R times in
mirrored order (0 1 2 4 4 2 1 0 ...) and reports each setting's median.

    python benchmarks/learner_step.py [--config configs/quickstart.yaml] [--steps 60] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import sluice_run_cmd  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from sluice.metrics import read_jsonl  # noqa: E402


def measure(
    config: Path, staleness: int, steps: int, warmup: int, run_dir: Path, overrides: list[str]
) -> dict:
    load_before = os.getloadavg()[0]
    t0 = time.time()
    cmd = sluice_run_cmd(
        config,
        f"run.dir={run_dir}",
        f"learner.total_steps={steps}",
        f"learner.max_staleness={staleness}",
        "learner.target_return=null",
        *overrides,
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"max_staleness={staleness}: sluice run failed:\n{proc.stderr[-3000:]}")
    records = read_jsonl(run_dir / "metrics" / "learner.jsonl")
    window = records[warmup:]
    elapsed = window[-1]["time"] - records[warmup - 1]["time"]
    pauses = [r["pause_s"] for p in (run_dir / "metrics").glob("rollout-*.jsonl") for r in read_jsonl(p)]
    return {
        "max_staleness": staleness,
        "steps_measured": len(window),
        "samples_per_s": sum(r["samples"] for r in window) / elapsed,
        "tokens_per_s": sum(r["tokens"] for r in window) / elapsed,
        "wait_frac": sum(r["wait_s"] for r in window) / sum(r["step_s"] for r in window),
        "s_per_step": elapsed / len(window),
        # the learner's own time per step (compute, weight publish, checkpoint): step minus data wait
        "busy_s_mean": sum(r["step_s"] - r["wait_s"] for r in window) / len(window),
        "compute_s_mean": sum(r["compute_s"] for r in window) / len(window),
        "sync_s_mean": sum(r["sync_s"] for r in window) / len(window),
        "staleness_mean": sum(r["staleness_mean"] for r in window) / len(window),
        "staleness_max": max(r["staleness_max"] for r in window),
        "dropped_stale": records[-1]["total_dropped_stale"],
        "rollout_pause_s": sum(pauses),
        "reward_last10": sum(r["reward_mean"] for r in records[-10:]) / min(10, len(records)),
        "wall_s": time.time() - t0,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }


def medians(measurements: list[dict]) -> dict:
    """The median of every number the measurements all hold."""
    keys = [k for k, v in measurements[0].items() if isinstance(v, (int, float))]
    return {
        k: statistics.median(m[k] for m in measurements) for k in keys if all(k in m for m in measurements)
    }


def median_row(runs: list[dict]) -> dict:
    """Median of every number over the repeats of one setting."""
    return {**medians(runs), "max_staleness": runs[0]["max_staleness"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart.yaml")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "learner_step.json")
    parser.add_argument("overrides", nargs="*", help="config overrides applied to every run")
    args = parser.parse_args()
    if args.warmup < 1 or args.warmup >= args.steps:
        parser.error("--warmup must be in [1, steps)")
    console = Console(width=170)
    order = [s for r in range(args.repeats) for s in (args.staleness if r % 2 == 0 else args.staleness[::-1])]
    runs = []
    with tempfile.TemporaryDirectory(prefix="sluice-learner-step-") as tmp:
        for i, s in enumerate(order):
            with console.status(f"run {i + 1}/{len(order)}: max_staleness={s}, {args.steps} learner steps"):
                runs.append(
                    measure(args.config, s, args.steps, args.warmup, Path(tmp) / f"r{i}", args.overrides)
                )
            console.print(
                f"max_staleness={s}: {runs[-1]['samples_per_s']:.1f} samples/s, "
                f"wait {100 * runs[-1]['wait_frac']:.0f}% (load {runs[-1]['load_before']:.1f})"
            )
    rows = [median_row([r for r in runs if r["max_staleness"] == s]) for s in args.staleness]
    base = next((r for r in rows if r["max_staleness"] == 0), rows[0])
    for r in rows:
        r["speedup_vs_baseline"] = r["samples_per_s"] / base["samples_per_s"]
    table = Table(
        title=f"Learner step at each staleness bound ({args.config.name}, baseline max_staleness="
        f"{base['max_staleness']})"
    )
    for col in (
        "max_staleness",
        "samples/s",
        "tokens/s",
        "speed-up",
        "data-wait",
        "compute s",
        "sync s",
        "staleness mean/max",
        "dropped",
        "rollout pause s",
        "load",
    ):
        table.add_column(col)
    for r in rows:
        table.add_row(
            str(r["max_staleness"]),
            f"{r['samples_per_s']:.1f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['speedup_vs_baseline']:.2f}x",
            f"{100 * r['wait_frac']:.1f}%",
            f"{r['compute_s_mean']:.3f}",
            f"{r['sync_s_mean']:.3f}",
            f"{r['staleness_mean']:.2f}/{r['staleness_max']}",
            str(r["dropped_stale"]),
            f"{r['rollout_pause_s']:.1f}",
            f"{r['load_before']:.1f}/{r['load_after']:.1f}",
        )
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "runs_raw": runs,
                "repeats": args.repeats,
                "config": str(args.config),
                "steps": args.steps,
                "warmup": args.warmup,
                "overrides": args.overrides,
                "cpus": os.cpu_count(),
                "medians": rows,
            },
            indent=2,
        )
    )
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
