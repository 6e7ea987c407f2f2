"""PNG plots of a run from its JSONL metrics: reward (with the held-out evaluation when the run
has one), staleness and throughput over time.

Written to `<run dir>/plots/` by the launchers when a run ends, or by `sluice plots RUN_DIR`.
Uses matplotlib's object API (`Figure`, Agg canvas): no pyplot state, safe in any process.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from sluice.metrics import read_jsonl


def write_run_plots(run_dir: str | Path) -> list[Path]:
    """Plots of whatever the run recorded; returns the files written (none without data)."""
    run_dir = Path(run_dir)
    learner = read_jsonl(run_dir / "metrics" / "learner.jsonl")
    rollouts = {p.stem: read_jsonl(p) for p in sorted((run_dir / "metrics").glob("rollout-*.jsonl"))}
    rollouts = {k: v for k, v in rollouts.items() if v}
    out = run_dir / "plots"
    written = []
    if learner:
        out.mkdir(exist_ok=True)
        evals = read_jsonl(run_dir / "metrics" / "eval.jsonl")
        written.append(_reward(learner, rollouts, evals, out / "reward.png"))
        written.append(_staleness(learner, out / "staleness.png"))
    if learner or rollouts:
        out.mkdir(exist_ok=True)
        written.append(_throughput(learner, rollouts, out / "throughput.png"))
    return written


def _col(records: list[dict], key: str) -> np.ndarray:
    return np.array([r.get(key, np.nan) for r in records], dtype=float)


def _smooth(y: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over `window` points (shorter at the start)."""
    if len(y) == 0:
        return y
    c = np.cumsum(np.nan_to_num(y))
    n = np.arange(1, len(y) + 1)
    lo = np.maximum(n - window, 0)
    return (c - np.concatenate([[0.0], c])[lo]) / (n - lo)


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _reward(learner: list[dict], rollouts: dict[str, list[dict]], evals: list[dict], path: Path) -> Path:
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    v, r = _col(learner, "version"), _col(learner, "reward_mean")
    ax.plot(v, r, alpha=0.3, color="C0", label="learner batch")
    ax.plot(v, _smooth(r, max(1, len(r) // 20)), color="C0", label="learner batch (smoothed)")
    for i, (name, recs) in enumerate(rollouts.items()):
        ax.plot(_col(recs, "version"), _col(recs, "reward_mean"), ".", ms=3, color=f"C{i + 1}", label=name)
    for mode, style in (("greedy", "k-o"), ("sampled", "k--s")):
        y = _col(evals, f"{mode}_reward")
        if np.isfinite(y).any():
            ax.plot(_col(evals, "version"), y, style, ms=3, lw=1, label=f"held-out eval ({mode})")
    ax.set_xlabel("policy version (learner steps)")
    ax.set_ylabel("mean reward")
    ax.set_title("Reward")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _staleness(learner: list[dict], path: Path) -> Path:
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    v = _col(learner, "version")
    ax.plot(v, _col(learner, "staleness_mean"), label="mean staleness of batch")
    ax.plot(v, _col(learner, "staleness_max"), label="max staleness of batch", alpha=0.7)
    ax.set_xlabel("policy version (learner steps)")
    ax.set_ylabel("versions behind the learner")
    ax.set_title("Staleness of consumed samples")
    dropped = _col(learner, "total_dropped_stale")
    if not np.all(np.isnan(dropped)):
        twin = ax.twinx()
        twin.plot(v, dropped, color="C3", ls="--", label="dropped as stale (total)")
        twin.set_ylabel("samples dropped (total)")
        twin.legend(loc="upper right", fontsize=8)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _rate(times: np.ndarray, counts: np.ndarray, t0: float, t1: float, bins: int) -> tuple:
    """Samples per second in `bins` equal windows of [t0, t1] (window centres, rates)."""
    edges = np.linspace(t0, t1, bins + 1)
    sums, _ = np.histogram(times, bins=edges, weights=counts)
    return (edges[:-1] + edges[1:]) / 2 - t0, sums / np.diff(edges)


def _throughput(learner: list[dict], rollouts: dict[str, list[dict]], path: Path) -> Path:
    fig = Figure(figsize=(7, 5.5))
    ax, wait_ax = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    all_times = [_col(learner, "time")] + [_col(r, "time") for r in rollouts.values()]
    times = np.concatenate([t for t in all_times if len(t)])
    t0, t1 = float(np.nanmin(times)), float(np.nanmax(times))
    t1 = max(t1, t0 + 1.0)
    bins = int(np.clip((t1 - t0) / 2.0, 5, 60))
    if learner:
        x, y = _rate(_col(learner, "time"), _col(learner, "samples"), t0, t1, bins)
        ax.plot(x, y, lw=2, label="learner (trained)")
        wait_ax.plot(_col(learner, "time") - t0, 100 * _col(learner, "wait_frac"), color="C0")
    for i, (name, recs) in enumerate(rollouts.items()):
        x, y = _rate(_col(recs, "time"), _col(recs, "samples"), t0, t1, bins)
        ax.plot(x, y, color=f"C{i + 1}", label=f"{name} (generated)")
    ax.set_ylabel("samples / s")
    ax.set_title("Throughput")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    wait_ax.set_ylabel("learner waiting\nfor data (%)")
    wait_ax.set_xlabel("seconds since the first record")
    wait_ax.set_ylim(0, 100)
    wait_ax.grid(alpha=0.3)
    return _save(fig, path)
