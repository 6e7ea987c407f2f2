"""Sluice against TRL seed by seed: the statistics of paired runs that vs_trl.py reports for one
pass and vs_trl_pool.py for several passes pooled (docs/architecture.md, "Steps to a reward are a
distribution over seeds").

Per threshold: on how many seeds each system reached it, and over the seeds where both did,
Sluice/TRL in steps and in time: on how many seeds Sluice took more, the sign test's two-sided p
(`scipy.stats.binomtest`; ties left out), the geometric mean of the ratios with a 95% bootstrap
interval (`scipy.stats.bootstrap`, BCa, a fixed seed) and their median. Each seed's first run of
each system stands for it (later `--repeats` are draws of the same seed, not more seeds). scipy,
not hand-written tests and resampling: it is the reference implementation, and it comes with the
benchmark extra (scripts/setup_bench.sh) that TRL needs anyway; without TRL's runs there are no
pairs and scipy is not imported.
"""

from __future__ import annotations

import statistics

import numpy as np
from rich.table import Table

SYSTEMS = ("sluice", "trl")
BOOTSTRAP_SEED = 0


def first_runs_of(runs: list[dict]) -> list[dict]:
    """Each seed's first run of each system (repeat 0)."""
    return [r for r in runs if not r.get("repeat", 0)]


def paired(pairs: list[tuple[float, float]]) -> dict:
    """Sluice/TRL over seeds, each pair (sluice, trl): the module docstring's statistics."""
    if not pairs:
        return {"seeds": 0}
    from scipy import stats

    logs = np.log([s / t for s, t in pairs])
    more, fewer = int((logs > 0).sum()), int((logs < 0).sum())
    interval = None
    if len(logs) >= 3 and np.ptp(logs) > 0:
        ci = stats.bootstrap(
            (logs,), np.mean, method="BCa", rng=np.random.default_rng(BOOTSTRAP_SEED)
        ).confidence_interval
        if np.isfinite([ci.low, ci.high]).all():  # BCa gives NaN where the resamples degenerate
            interval = [float(np.exp(ci.low)), float(np.exp(ci.high))]
    return {
        "seeds": len(pairs), "sluice_more": more, "sluice_fewer": fewer,
        "sign_p": float(stats.binomtest(more, more + fewer).pvalue) if more + fewer else None,
        "geomean_ratio": float(np.exp(logs.mean())), "geomean_95": interval,
        "median_ratio": float(np.exp(np.median(logs))),
    }  # fmt: skip


def by_threshold(runs: list[dict], thresholds: list[float]) -> dict[str, dict]:
    """Per threshold: seeds reached by each system, their median steps, and the paired ratios
    over the seeds both reached (one task's runs)."""
    of = {(r["seed"], r["system"]): r for r in first_runs_of(runs)}
    seeds = sorted({r["seed"] for r in runs})
    out = {}
    for thr in map(str, thresholds):
        cross = {
            system: {s: c for s in seeds if (r := of.get((s, system))) and (c := r["crossings"].get(thr))}
            for system in SYSTEMS
        }
        both = [s for s in seeds if s in cross["sluice"] and s in cross["trl"]]
        out[thr] = {
            "runs": {system: sum((s, system) in of for s in seeds) for system in SYSTEMS},
            "reached": {system: len(cross[system]) for system in SYSTEMS},
            "median_steps": {
                system: statistics.median(c["step"] for c in cross[system].values())
                if cross[system]
                else None
                for system in SYSTEMS
            },
            "steps": paired([(cross["sluice"][s]["step"], cross["trl"][s]["step"]) for s in both]),
            "time": paired([(cross["sluice"][s]["time_s"], cross["trl"][s]["time_s"]) for s in both]),
        }
    return out


def per_step(runs: list[dict]) -> dict:
    """Sluice's time per step over TRL's, seed by seed (each run's clock / steps to its stop)."""
    of = {(r["seed"], r["system"]): r for r in first_runs_of(runs)}
    ratios = sorted(
        of[(s, "sluice")]["s_per_step"] / of[(s, "trl")]["s_per_step"]
        for s in sorted({r["seed"] for r in runs})
        if all(of.get((s, system), {}).get("s_per_step") for system in SYSTEMS)
    )
    if not ratios:
        return {"seeds": 0}
    return {"seeds": len(ratios), "median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]}


def ratio_cell(p: dict) -> str:
    """'1.06 [0.98, 1.15], median 1.10; more on 30 of 50 (p 0.20)'."""
    if not p["seeds"]:
        return "-"
    ci = p["geomean_95"]
    band = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""
    sign = "-" if p["sign_p"] is None else f"{p['sign_p']:.2g}"
    return (
        f"{p['geomean_ratio']:.2f}{band}, median {p['median_ratio']:.2f}; "
        f"more on {p['sluice_more']} of {p['seeds']} (p {sign})"
    )


def pairs_table(title: str, thresholds: dict[str, dict]) -> Table:
    """A row per threshold of `by_threshold`'s result; the caller may add rows of its own."""
    table = Table(title=title)
    for col in (
        "threshold",
        "reached (S / T)",
        "median steps (S / T)",
        "steps: Sluice/TRL",
        "time: Sluice/TRL",
    ):
        table.add_column(col)
    for thr, t in thresholds.items():
        reached = f"{t['reached']['sluice']} / {t['reached']['trl']}"
        steps = " / ".join(
            "-" if t["median_steps"][s] is None else f"{t['median_steps'][s]:.0f}" for s in SYSTEMS
        )
        table.add_row(thr, reached, steps, ratio_cell(t["steps"]), ratio_cell(t["time"]))
    return table
