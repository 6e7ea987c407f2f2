"""CartPole-v1 to a mean return of 475 through Sluice's actor-learner path, on several seeds,
against RLlib PPO with its defaults on the same machine in the same run.

Sluice: `sluice run configs/cartpole.yaml` as real processes (buffer shard, two env rollout
services, the learner, weight sync), stopped by `learner.target_return` when the mean return
of the last 100 episodes reaches 475. Time to target = the learner's metrics line of that step
minus the moment the launcher was started (process start-up included). Env steps: sampled by
the actors up to then, and trained by the learner.

RLlib: PPOConfig().environment("CartPole-v1") with its defaults, in a subprocess, trained until
`env_runners/episode_return_mean` >= 475; timed the same way from the subprocess start.

    python benchmarks/cartpole.py [--seeds 0 1 2] [--baseline rllib|none] [--out PATH]

Prints a table and writes JSON (default benchmarks/results/cartpole.json). The machine may be
shared: the load average before and after each run is recorded next to its numbers.
"""

from __future__ import annotations

import argparse
import json
import os
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

TARGET = 475.0


def run_sluice(config: Path, seed: int, run_dir: Path, timeout_s: float, overrides: list[str]) -> dict:
    load_before = os.getloadavg()[0]
    t0 = time.time()
    cmd = sluice_run_cmd(
        config,
        f"run.dir={run_dir}",
        f"run.seed={seed}",
        f"env.seed={1000 * seed}",
        f"rollout.seed={seed}",
        f"model.mlp.seed={seed}",
        *overrides,
    )
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = None
    wall = time.time() - t0
    steps = read_jsonl(run_dir / "metrics" / "learner.jsonl")
    result = {
        "system": "sluice",
        "seed": seed,
        "exit_code": code,
        "wall_s": wall,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "run_dir": str(run_dir),
    }
    if not steps:
        return {**result, "reached": False}
    last = steps[-1]
    reached = last.get("episode_return_mean", 0.0) >= TARGET
    until = last["time"]
    sampled = sum(
        r["steps"]
        for p in (run_dir / "metrics").glob("rollout-*.jsonl")
        for r in read_jsonl(p)
        if r["time"] <= until
    )
    return {
        **result,
        "reached": reached,
        "time_to_target_s": until - t0 if reached else None,
        "first_step_s": steps[0]["time"] - t0,
        "learner_steps": last["version"],
        "env_steps_sampled": sampled,
        "env_steps_trained": last["total_tokens"],
        "return_mean": last.get("episode_return_mean"),
        "wait_frac_mean": sum(s["wait_frac"] for s in steps) / len(steps),
    }


# Runs in a fresh interpreter: python -c RLLIB_WORKER t0 seed limit_s target
RLLIB_WORKER = """
import json, os, sys, time
t0, seed, limit, target = float(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
import ray
from ray.rllib.algorithms.ppo import PPOConfig
ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
algo = PPOConfig().environment("CartPole-v1").debugging(seed=seed).build_algo()
ret, steps, reached = 0.0, 0, False
while time.time() - t0 < limit and not reached:
    r = algo.train()["env_runners"]
    ret, steps = float(r.get("episode_return_mean", 0.0)), int(r.get("num_env_steps_sampled_lifetime", 0))
    reached = ret >= target
out = {"reached": reached, "env_steps_sampled": steps, "return_mean": ret}
if reached:
    out["time_to_target_s"] = time.time() - t0
print(json.dumps(out), flush=True)
algo.stop()
ray.shutdown()
"""


def run_rllib(seed: int, timeout_s: float) -> dict:
    load_before = os.getloadavg()[0]
    t0 = time.time()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", RLLIB_WORKER, str(t0), str(seed), str(timeout_s), str(TARGET)],
            capture_output=True,
            text=True,
            timeout=timeout_s + 120,
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        out = json.loads(lines[-1]) if lines else {"reached": False, "error": proc.stderr[-2000:]}
    except subprocess.TimeoutExpired:
        out = {"reached": False, "error": "timeout"}
    return {
        "system": "rllib_ppo",
        "seed": seed,
        "wall_s": time.time() - t0,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        **out,
    }


def fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "cartpole.yaml")
    parser.add_argument("--baseline", choices=["rllib", "none"], default="rllib")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cartpole.json")
    parser.add_argument("overrides", nargs="*", help="config overrides for the Sluice runs")
    args = parser.parse_args()
    if args.baseline == "rllib":
        try:
            import ray.rllib.algorithms.ppo  # noqa: F401
        except ImportError as e:
            parser.error(
                f"the RLlib baseline needs RLlib's imports ({e}): "
                "pip install '.[ray,bench]', or pass --baseline none"
            )
    console = Console(width=170)
    results = []
    with tempfile.TemporaryDirectory(prefix="sluice-cartpole-") as tmp:
        for seed in args.seeds:
            with console.status(f"sluice, seed {seed}"):
                results.append(
                    run_sluice(args.config, seed, Path(tmp) / f"seed{seed}", args.timeout, args.overrides)
                )
            r = results[-1]
            console.print(
                f"sluice seed {seed}: reached={r['reached']} in {fmt(r.get('time_to_target_s'))} s, "
                f"{r.get('env_steps_sampled')} env steps (load {r['load_before']:.1f})"
            )
            if args.baseline == "rllib":
                with console.status(f"RLlib PPO, seed {seed}"):
                    results.append(run_rllib(seed, args.timeout))
                r = results[-1]
                console.print(
                    f"rllib  seed {seed}: reached={r['reached']} in {fmt(r.get('time_to_target_s'))} s, "
                    f"{r.get('env_steps_sampled')} env steps (load {r['load_before']:.1f})"
                )
    table = Table(title=f"CartPole-v1: time to a mean return of {TARGET:.0f} (last 100 episodes)")
    for col in (
        "system",
        "seed",
        "reached",
        "time to 475 (s)",
        "first step (s)",
        "env steps sampled",
        "env steps trained",
        "learner steps",
        "load avg before/after",
    ):
        table.add_column(col)
    for r in results:
        table.add_row(
            r["system"],
            str(r["seed"]),
            str(r["reached"]),
            fmt(r.get("time_to_target_s")),
            fmt(r.get("first_step_s")),
            str(r.get("env_steps_sampled", "-")),
            str(r.get("env_steps_trained", "-")),
            str(r.get("learner_steps", "-")),
            f"{r['load_before']:.1f} / {r['load_after']:.1f}",
        )
    console.print(table)
    ours = [r["time_to_target_s"] for r in results if r["system"] == "sluice" and r["reached"]]
    theirs = [r["time_to_target_s"] for r in results if r["system"] == "rllib_ppo" and r["reached"]]
    summary = {
        "sluice_max_s": max(ours) if ours else None,
        "rllib_best_s": min(theirs) if theirs else None,
        "sluice_all_reached": len(ours) == len(args.seeds),
    }
    if ours and theirs:
        summary["rllib_best_over_sluice_worst"] = min(theirs) / max(ours)
    console.print(summary)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "target": TARGET,
                "config": str(args.config),
                "overrides": args.overrides,
                "cpus": os.cpu_count(),
                "runs": results,
                "summary": summary,
            },
            indent=2,
        )
    )
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
