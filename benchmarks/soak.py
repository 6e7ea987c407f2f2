"""Soak: the quickstart trained for a fixed time; each role's memory and open files, sampled.

A long run must not leak: every role's resident memory (RSS) and open file descriptors are
sampled every `--interval` seconds (psutil, the role processes the run's endpoints name, a
restarted one followed) and compared between the first sample after `--warmup` (default: half
the run, once bounded structures are full: a shard's dedupe window of `buffer.dedupe_window`
ids, ~15 MiB, filled in the first ~3 minutes of the quickstart) and the last.
A role is flat when its anonymous memory (RSS less file-backed pages) grew by less than 10% and
its descriptors other than mapped log segments by at most 5. Mapped segments are reported
apart: a same-host reader maps the shard's segment files (up to 8 per shard, `SegmentMaps`),
and their pages count in RSS as clean file pages the kernel can reclaim. Durable
shards with checkpoints every 50 steps and the experience archive off (the archive grows by
design) exercise the log's compaction and recycling all along.

    python benchmarks/soak.py [--minutes 10] [--interval 10] [--warmup S] [--out benchmarks/results/soak]
    python benchmarks/soak.py --quick      # smoke test: 12 s once every role is up, not a measurement

Prints a table and writes <out>/soak.json and <out>/soak.png (RSS and descriptors over time).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
from common import figure, sluice_run_cmd, write_report
from rich.console import Console
from rich.table import Table

from sluice.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
RSS_GROWTH, FD_GROWTH = 0.10, 5  # what still counts as flat


def sample(run_dir: Path) -> dict[str, dict]:
    """Of every role process the run's endpoints name now: rss_mb, anon_mb (RSS less the
    file-backed and shared pages: what a leak grows), fds, and seg_fds (descriptors of mapped
    log segments: a same-host reader keeps up to 8 per shard, SegmentMaps)."""
    out = {}
    for rec in (run_dir / "endpoints").glob("*.json"):
        try:
            p = psutil.Process(json.loads(rec.read_text())["pid"])
            mem = p.memory_info()
            segs = sum(f.path.endswith(".seg") for f in p.open_files())
            out[rec.stem] = {
                "rss_mb": mem.rss / 2**20, "anon_mb": (mem.rss - mem.shared) / 2**20,
                "fds": p.num_fds(), "seg_fds": segs,
            }  # fmt: skip
        except (psutil.NoSuchProcess, json.JSONDecodeError, KeyError):
            continue
    return out


def soak(run_dir: Path, seconds: float, interval: float, console: Console) -> tuple[list[dict], int, int]:
    """Run the quickstart for `seconds` once it is up, sampling; then Ctrl-C it. (samples,
    steps, exit code)"""
    overrides = (
        f"run.dir={run_dir}", "rollout.engine=hf", "learner.total_steps=100000000",
        "learner.checkpoint_every=50", "metrics.tensorboard=true",
    )  # fmt: skip
    proc = subprocess.Popen(
        sluice_run_cmd(ROOT / "configs" / "quickstart.yaml", *overrides),
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    samples: list[dict] = []
    try:
        wait_until_up(proc, run_dir, timeout_s=300)
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            if proc.poll() is not None:
                raise RuntimeError(f"the run ended early (exit {proc.returncode}); logs in {run_dir}/logs")
            samples.append({"t": time.monotonic() - t0, "roles": sample(run_dir)})
            console.print(
                f"{samples[-1]['t']:6.0f} s: {len(read_jsonl(run_dir / 'metrics' / 'learner.jsonl'))} steps"
            )
            time.sleep(interval)
    finally:
        os.kill(proc.pid, signal.SIGINT)  # as Ctrl-C: every role stops in order
        code = proc.wait(timeout=120)
    return samples, len(read_jsonl(run_dir / "metrics" / "learner.jsonl")), code


def wait_until_up(proc: subprocess.Popen, run_dir: Path, timeout_s: float) -> None:
    """Until every role the run plans (sluice.launch.plan) has recorded its endpoint and the
    learner has logged a step: the soak's clock starts there, not at the launch (start-up took
    over 25 s on a slow machine, longer than a whole quick soak)."""
    from sluice.config import load_config
    from sluice.launch.plan import plan_roles

    deadline = time.monotonic() + timeout_s
    roles: set[str] | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the run ended while starting (exit {proc.returncode}); logs in {run_dir}/logs"
            )
        if roles is None and (run_dir / "config.yaml").is_file():
            roles = {spec.name for spec in plan_roles(load_config(run_dir / "config.yaml"))}
        recorded = {f.stem for f in (run_dir / "endpoints").glob("*.json")}
        if roles is not None and roles <= recorded and read_jsonl(run_dir / "metrics" / "learner.jsonl"):
            return
        time.sleep(0.5)
    raise TimeoutError(f"the run's roles were not all up, with a learner step, in {timeout_s:.0f} s")


def summarise(samples: list[dict], warmup: float) -> list[dict]:
    """Per role: first sample after the warm-up against the last. Flat: anonymous memory grew
    by less than RSS_GROWTH and descriptors other than mapped segments by at most FD_GROWTH
    (mapped segments are file pages the kernel reclaims, bounded by SegmentMaps.keep)."""
    later = [s for s in samples if s["t"] >= warmup] or samples
    rows = []
    for role in sorted(later[-1]["roles"]):
        have = [s for s in later if role in s["roles"]]
        a, b = have[0]["roles"][role], have[-1]["roles"][role]
        growth = b["anon_mb"] / a["anon_mb"] - 1
        other = (b["fds"] - b["seg_fds"]) - (a["fds"] - a["seg_fds"])
        rows.append({
            "role": role, "t0": have[0]["t"], "t1": have[-1]["t"],
            "rss_start_mb": a["rss_mb"], "rss_end_mb": b["rss_mb"],
            "anon_start_mb": a["anon_mb"], "anon_end_mb": b["anon_mb"], "anon_growth": growth,
            "fds_start": a["fds"], "fds_end": b["fds"], "seg_fds_end": b["seg_fds"],
            "flat": growth < RSS_GROWTH and other <= FD_GROWTH,
        })  # fmt: skip
    return rows


def plot(samples: list[dict], path: Path) -> None:
    roles = sorted({r for s in samples for r in s["roles"]})
    with figure(path, ncols=2, size=(12, 4.5)) as (rss, fds):
        for role in roles:
            have = [s for s in samples if role in s["roles"]]
            ts = [s["t"] for s in have]
            line = rss.plot(ts, [s["roles"][role]["rss_mb"] for s in have], label=f"{role} RSS")[0]
            rss.plot(ts, [s["roles"][role]["anon_mb"] for s in have], ls="--", color=line.get_color())
            fds.plot(ts, [s["roles"][role]["fds"] for s in have], label=role)
        rss.set(title="resident memory per role (dashed: anonymous)", xlabel="s", ylabel="MiB")
        fds.set(title="open file descriptors per role", xlabel="s", ylabel="fds")
        rss.legend()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--interval", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=None, help="s ignored first (default: half the run)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "soak")
    ap.add_argument("--quick", action="store_true", help="12 s, samples every 2 s: a smoke test")
    args = ap.parse_args()
    if args.quick:
        args.minutes, args.interval, args.warmup = 12 / 60, 2.0, 4.0
    if args.warmup is None:  # bounded structures fill first: the buffer's dedupe window took ~3 min
        args.warmup = args.minutes * 30
    console = Console()
    with tempfile.TemporaryDirectory(prefix="sluice-soak-") as work:
        samples, steps, code = soak(Path(work) / "run", args.minutes * 60, args.interval, console)
    rows = summarise(samples, args.warmup)
    t = Table(title=f"soak: {args.minutes:g} min, {steps} learner steps, exit {code}")
    for col in ("role", "from s", "to s", "RSS MiB", "anon MiB", "anon growth", "fds (segments)", "flat"):
        t.add_column(col, justify="left" if col == "role" else "right")
    for r in rows:
        rss = f"{r['rss_start_mb']:.0f} -> {r['rss_end_mb']:.0f}"
        anon = f"{r['anon_start_mb']:.0f} -> {r['anon_end_mb']:.0f}"
        fds = f"{r['fds_start']} -> {r['fds_end']} ({r['seg_fds_end']})"
        growth = f"{100 * r['anon_growth']:+.1f}%"
        flat = "yes" if r["flat"] else "NO"
        t.add_row(r["role"], f"{r['t0']:.0f}", f"{r['t1']:.0f}", rss, anon, growth, fds, flat)
    console.print(t)
    settings = {k: getattr(args, k) for k in ("minutes", "interval", "warmup", "quick")}
    payload = {"settings": settings, "steps": steps, "exit_code": code, "roles": rows, "samples": samples}
    write_report(console, args.out, "soak", payload, lambda p: plot(samples, p))
    return 0 if code == 130 and (args.quick or all(r["flat"] for r in rows)) else 1  # (quick: no verdict)


if __name__ == "__main__":
    raise SystemExit(main())
