"""Async speed-up against its ideal: generation alone, training alone, then full async runs of
one workload at several staleness bounds, in one run.

  generation  the workload's buffer shards and rollout services (started as `sluice run` starts
              them) feeding sluice.testing.drain's stand-in learner in this process: it consumes
              whole batches, ACKs them and publishes versions, and trains nothing (step_s 0).
              gen = seconds per batch_size samples.
  training    the real learner on the same batch shape with data never the bottleneck: sim
              rollouts with zero latency. train = the learner's busy time per step (step_s -
              wait_s: forward/backward, optimizer, weight publish).
  async       full `sluice run`s (benchmarks/learner_step.py's `measure`) at each
              learner.max_staleness: seconds per learner step after the warm-up.
  brackets    generation only and training only run again after each repeat of the async
              runs, and each async run is set against the mean of the two measurements around
              its repeat: the VM's speed drifts by +-15% over minutes. Rows are the medians over
              `--repeats` runs of a setting; the top-level gen and train the medians of all.

A synchronous system takes gen + train per step; perfect overlap takes max(gen, train). Per
setting: speed-up = (gen + train) / s_per_step, ideal = (gen + train) / max(gen, train), and
fraction of ideal = speed-up / ideal. The same against the run's own learner busy time is
reported too (`*_in_run`): on a shared machine the load drifts between runs, and on few cores
the training-only step also carries CPU contention (the zero-latency services and the learner's
prefetch thread run beside it), which the async runs see only when a batch is always waiting.
Each service's calls (admission pause, generate, build, PUT, period) are averaged per run.
`--warmup` must cover the backlog the services build while the learner starts (up to
max_staleness + 1 batches).

Workloads (both configs/quickstart.yaml):
  sim         rollout.engine=sim: generation is latency (sleeps, as GPU decode is to the CPU),
              its decode step tuned from the measured training step so that gen ~= train.
  quickstart  rollout.engine=hf: real CPU generation competing with training for the cores.

    python benchmarks/async_overlap.py --workload sim [--steps 60] [--warmup 10] [--staleness 0 1 2 4] \
        [--repeats 1] [--out benchmarks/results/async_overlap]
    python benchmarks/async_overlap.py --workload quickstart
    python benchmarks/async_overlap.py --override learner.torch_threads=1   # any config override
    python benchmarks/async_overlap.py --quick          # smoke test: short runs, not a measurement

Prints a table and writes <out>/<workload>.json and <out>/<workload>.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from learner_step import ROOT, measure, median_row, medians
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sluice.config.loader import dump_config, load_config
from sluice.config.run import RunConfig
from sluice.launch.local import LocalLauncher
from sluice.launch.plan import plan_roles
from sluice.launch.role import quiet_libraries
from sluice.metrics import read_jsonl
from sluice.testing.drain import Drain

CONFIG = ROOT / "configs" / "quickstart.yaml"
TARGET_STALENESS, TARGET_FRACTION = 2, 0.9  # issue 11: speed-up at max_staleness 2 >= 90% of ideal
TRAIN_STALENESS = 4  # training-only runs: slack enough that a batch is always waiting
LOOSE_STALENESS = 1000  # generation-only: admission never throttles the services
ZERO_LATENCY = ["call_s", "prefill_s_per_token", "decode_step_s", "decode_s_per_seq"]


def sim_overrides(**latency: float) -> list[str]:
    """Sim-engine overrides: every latency term named in ZERO_LATENCY is 0 unless given."""
    return ["rollout.engine=sim"] + [f"rollout.sim.{k}={latency.get(k, 0.0)!r}" for k in ZERO_LATENCY]


def decode_step_per_gen_s(cfg: RunConfig) -> float:
    """Sim decode-step seconds per second of generating one learner batch, with every other
    latency term 0: services generate in parallel, each call has max_new_tokens decode rounds
    (a call ends when its longest sequence does), and one learner batch takes
    batch_size / (services * samples per call) calls of each service."""
    rc = cfg.rollout
    calls = cfg.learner.batch_size / (max(1, rc.services) * rc.prompts_per_batch * rc.group_size)
    return 1.0 / (calls * rc.max_new_tokens)


def overlap(s_per_step: float, gen_s: float, train_s: float) -> dict[str, float]:
    """Speed-up over the synchronous sum and the fraction of the ideal overlap it achieves."""
    sync = gen_s + train_s
    ideal = sync / max(gen_s, train_s)
    speedup = sync / s_per_step
    return {"speedup": speedup, "ideal_speedup": ideal, "fraction_of_ideal": speedup / ideal}


def bracket(run: dict, trains: list[dict], gens: list[dict]) -> None:
    """Set an async run against the mean of the training-only and generation-only measurements
    just before and just after its repeat (its `gen_s`, `train_s`), and against its own learner
    busy time (`*_in_run`)."""
    run["gen_s"] = statistics.mean(g["s_per_step"] for g in gens)
    run["train_s"] = statistics.mean(t["busy_s_mean"] for t in trains)
    run.update(overlap(run["s_per_step"], run["gen_s"], run["train_s"]))
    in_run = overlap(run["s_per_step"], run["gen_s"], run["busy_s_mean"])
    run.update({f"{k}_in_run": v for k, v in in_run.items()})


def call_parts(r: dict) -> str:
    """One line: where a rollout call's time went (means of `rollout_calls`, prefixed rollout_)."""
    parts = ("pause", "generate", "score", "put")
    return f"rollout call every {r['rollout_period_s_mean']:.3f} s: " + ", ".join(
        f"{p} {r[f'rollout_{p}_s_mean']:.3f}" for p in parts
    )


def rollout_calls(run_dir: Path, skip: int) -> dict[str, float]:
    """What the rollout services' generation calls took, averaged over every service's calls
    after its first `skip`: paused for admission, generating, building trajectories, in PUT, and
    the period from one call's end to the next one's (all of it, RPCs included)."""
    services = [read_jsonl(p)[skip:] for p in sorted((run_dir / "metrics").glob("rollout-*.jsonl"))]
    calls = [c for s in services for c in s]
    periods = [b["time"] - a["time"] for s in services for a, b in zip(s, s[1:])]

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else float("nan")

    out = {f"{k}_mean": mean([c[k] for c in calls]) for k in ("pause_s", "generate_s", "score_s", "put_s")}
    return {"calls": len(calls), **out, "period_s_mean": mean(periods)}


class StepClock:
    """Drain timeline sink (duck-types JsonlLog.write): the time of every consumption step;
    `done` is set once `total` steps were taken."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.times: list[float] = []
        self.done = threading.Event()

    def write(self, record: dict) -> None:
        self.times.append(time.perf_counter())
        if len(self.times) >= self.total:
            self.done.set()


class GenerationOnly(LocalLauncher):
    """`sluice run`'s buffer shards and rollout services, consumed by sluice.testing.drain's Drain
    in this process instead of a learner: generation throughput with nothing trained. Services
    with a model get the initial weights (version 0) once from a broadcaster here; sim services
    learn versions from the control plane."""

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg, show_progress=False)
        self.sim = self.cfg.rollout.engine == "sim"
        self.drain: Drain | None = None
        self.broadcaster = None

    def prepare(self) -> Path:
        if not self.sim:
            return super().prepare()
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)  # sim: no model directory
        config_path = self.run_dir / "config.yaml"
        dump_config(self.cfg, config_path)
        return config_path

    def start(self) -> None:
        config_path = self.prepare()
        self.drain = Drain(self.cfg)  # binds the control plane the services ADMIT at
        if not self.sim:
            self._publish_initial_weights()
        for spec in plan_roles(self.cfg):
            if spec.kind != "learner":  # the drain here stands in for it
                self._spawn(spec, config_path)

    def _publish_initial_weights(self) -> None:
        import torch

        from sluice.modeling.policy import load_policy_model, materialize_policy_dir
        from sluice.weight_sync.broadcaster import WeightBroadcaster

        cpu = torch.device("cpu")
        model, _ = load_policy_model(self.cfg, materialize_policy_dir(self.cfg), cpu)
        self.broadcaster = WeightBroadcaster(self.cfg.weight_sync, cpu, self.cfg.model.dtype)
        self.broadcaster.start(self.drain.control, self.cfg.control.endpoint)
        self.broadcaster.publish(0, model)  # services joining later pull this snapshot

    def time_steps(self, steps: int, warmup: int, timeout_s: float) -> float:
        """Seconds per drain step (one learner batch) over `steps` steps after `warmup`."""
        clock, stop = StepClock(warmup + steps), threading.Event()
        thread = threading.Thread(target=self.drain.run, args=(stop, clock), name="drain", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        try:
            while not clock.done.wait(timeout=1.0):
                dead = [c.name for c in self.children if c.proc.poll() is not None]
                if dead or not thread.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"generation-only: {len(clock.times)}/{clock.total} batches, dead roles {dead}; "
                        f"logs in {self.run_dir / 'logs'}"
                    )
        finally:
            stop.set()
            thread.join(timeout=30)
        t = clock.times
        return (t[warmup + steps - 1] - t[warmup - 1]) / steps

    def close(self) -> None:
        self.shutdown()
        if self.broadcaster is not None:
            self.broadcaster.close(leave_wait_s=0.0)
        if self.drain is not None:
            self.drain.close()


@dataclass
class Workload:
    name: str
    overrides: list[str]  # applied to every measurement of the workload
    sim_generation: bool  # generation is sim latency, tuned to the measured training step
    config: Path = CONFIG

    def load(self, *extra: str) -> RunConfig:
        return load_config(self.config, [*self.overrides, *extra])


WORKLOADS = {
    "sim": Workload("sim", sim_overrides(), sim_generation=True),
    "quickstart": Workload("quickstart", ["rollout.engine=hf"], sim_generation=False),
}


@dataclass
class AsyncOverlapBench:
    workload: Workload
    steps: int
    warmup: int
    staleness: list[int]
    work: Path
    repeats: int = 1  # async runs of each setting, in mirrored order (0 1 2 4 4 2 1 0 ...); medians
    tune_passes: int = 2  # sim: measure, correct the decode step for the fixed overheads, measure
    console: Console = field(default_factory=Console)

    def run(self) -> dict:
        """Training only, generation (tuned to it), then per repeat the async runs in mirrored
        order, and after each repeat training only and generation only again. The VM's speed
        drifts by +-15% over minutes, so each async run is set against the mean of the
        measurements just before and just after its repeat (`bracket`), and each setting's row
        holds the medians over its runs."""
        load_start = os.getloadavg()
        orders = [self.staleness[:: -1 if i % 2 else 1] for i in range(self.repeats)]
        tune = self.tune_passes if self.workload.sim_generation else 1
        phases = 2 * self.repeats + 1 + tune + sum(map(len, orders))
        with Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(), console=self.console, transient=True,
        ) as progress:  # fmt: skip
            self._progress, self._task = progress, progress.add_task("starting", total=phases)
            trains = [self.training_only("train-0")]
            gen_overrides, first_gen = self.generation(trains[0]["busy_s_mean"])
            gens, runs = [first_gen], []
            for i, order in enumerate(orders):
                runs += [{**self.async_run(s, gen_overrides, f"async-{i}-s{s}"), "repeat": i} for s in order]
                trains.append(self.training_only(f"train-{i + 1}"))
                gens.append(self.generation_only(gen_overrides))
        for r in runs:
            bracket(r, trains[r["repeat"] : r["repeat"] + 2], gens[r["repeat"] : r["repeat"] + 2])
        rows = [median_row([r for r in runs if r["max_staleness"] == s]) for s in self.staleness]
        decode = first_gen.get("decode_step_s")
        result = self.result(median_row(trains), medians(gens), decode, gen_overrides, rows, load_start)
        return {
            **result,
            "repeats": self.repeats,
            "runs_raw": runs,
            "training_raw": trains,
            "generation_raw": gens,
        }

    def _phase(self, what: str) -> None:
        self._progress.update(self._task, description=what)

    def _done(self, what: str) -> None:
        self._progress.advance(self._task)
        self.console.print(what)

    def training_only(self, name: str) -> dict:
        self._phase("training only (sim rollouts, zero latency)")
        extra = [*sim_overrides(), f"learner.max_staleness={TRAIN_STALENESS}"]
        r = self._measure(TRAIN_STALENESS, extra, name)
        self._done(
            f"training only: {r['busy_s_mean']:.3f} s busy per step, data wait {100 * r['wait_frac']:.1f}%"
        )
        return r

    def generation(self, train_s: float) -> tuple[list[str], dict]:
        """(overrides that set the workload's generation, generation-only measurement)."""
        if not self.workload.sim_generation:
            return [], self.generation_only([])
        k = decode_step_per_gen_s(self.workload.load())
        decode, gen = 0.0, {"s_per_step": 0.0}
        for _ in range(self.tune_passes):
            # first the decode rounds alone; then also what the services spend besides them
            # (admission, PUT), taken as additive
            decode = max(1e-4, decode + k * (train_s - gen["s_per_step"]))
            overrides = sim_overrides(decode_step_s=decode)
            gen = self.generation_only(overrides)
        gen["decode_step_s"] = decode
        return overrides, gen

    def generation_only(self, gen_overrides: list[str]) -> dict:
        self._phase("generation only (stand-in learner: sluice.testing.drain)")
        cfg = self.workload.load(*gen_overrides, f"learner.max_staleness={LOOSE_STALENESS}")
        cfg.run.dir = str(self.work / f"gen-{len(list(self.work.glob('gen-*')))}")
        launcher = GenerationOnly(cfg)
        try:
            launcher.start()
            s = launcher.time_steps(self.steps, self.warmup, timeout_s=120 + 20 * (self.steps + self.warmup))
        finally:
            launcher.close()
        r = {"s_per_step": s, "samples_per_s": cfg.learner.batch_size / s}
        r.update({f"rollout_{k}": v for k, v in rollout_calls(cfg.run_dir, self.warmup).items()})
        self._done(
            f"generation only: {s:.3f} s per batch ({r['samples_per_s']:.0f} samples/s); {call_parts(r)}"
        )
        return r

    def async_run(self, staleness: int, gen_overrides: list[str], name: str) -> dict:
        self._phase(f"async run, max_staleness={staleness}")
        r = self._measure(staleness, gen_overrides, name)
        r.update({f"rollout_{k}": v for k, v in rollout_calls(self.work / name, self.warmup).items()})
        self._done(
            f"max_staleness={staleness}: {r['s_per_step']:.3f} s/step, data wait {100 * r['wait_frac']:.0f}%"
        )
        return r

    def _measure(self, staleness: int, extra: list[str], name: str) -> dict:
        overrides = [*self.workload.overrides, *extra]
        return measure(self.workload.config, staleness, self.steps, self.warmup, self.work / name, overrides)

    def result(
        self,
        train: dict,
        gen: dict,
        decode_step_s: float | None,
        gen_overrides: list[str],
        rows: list[dict],
        load: tuple,
    ) -> dict:
        """The JSON: per setting the medians of its runs' bracketed figures (`rows`); at the top
        the medians of every generation-only and training-only measurement."""
        g, t = gen["s_per_step"], train["busy_s_mean"]
        target = next((r for r in rows if r["max_staleness"] == TARGET_STALENESS), None)
        return {
            "workload": self.workload.name,
            "config": str(self.workload.config),
            "overrides": [*self.workload.overrides, *gen_overrides],
            "steps": self.steps,
            "warmup": self.warmup,
            "batch_size": self.workload.load().learner.batch_size,
            "generation": {**gen, "decode_step_s": decode_step_s},
            "training": train,
            "gen_s": g,
            "train_s": t,
            "sync_s_per_step": g + t,
            "ideal_s_per_step": max(g, t),
            "ideal_speedup": (g + t) / max(g, t),
            "rows": rows,
            "target": {
                "max_staleness": TARGET_STALENESS,
                "min_fraction": TARGET_FRACTION,
                "fraction": target["fraction_of_ideal"] if target else None,
                "met": bool(target and target["fraction_of_ideal"] >= TARGET_FRACTION),
            },
            "machine": {"cpus": os.cpu_count(), "load_avg_start": load, "load_avg_end": os.getloadavg()},
        }


def report(result: dict, console: Console) -> None:
    g, t = result["generation"], result["training"]
    console.print(
        f"generation only: {result['gen_s']:.3f} s per batch; {call_parts(g)}\n"
        f"training only: {result['train_s']:.3f} s busy per step (compute {t['compute_s_mean']:.3f}, "
        f"weight publish {t['sync_s_mean']:.3f}), data wait {100 * t['wait_frac']:.1f}%"
    )
    table = Table(
        title=f"async overlap, workload {result['workload']}: synchronous {result['sync_s_per_step']:.3f} s "
        f"per step, ideal {result['ideal_s_per_step']:.3f} s ({result['ideal_speedup']:.2f}x)"
        + (f", medians of {result['repeats']} runs" if result["repeats"] > 1 else "")
    )
    for col in ("max_staleness", "s/step", "gen / train s", "speed-up", "of ideal", "of ideal, in-run train",
                "learner busy s",
                "data wait", "staleness max", "rollout call s", "pause s", "put s", "load"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in result["rows"]:
        table.add_row(
            str(r["max_staleness"]), f"{r['s_per_step']:.3f}", f"{r['gen_s']:.3f} / {r['train_s']:.3f}",
            f"{r['speedup']:.2f}x",
            f"{100 * r['fraction_of_ideal']:.0f}%", f"{100 * r['fraction_of_ideal_in_run']:.0f}%",
            f"{r['busy_s_mean']:.3f}", f"{100 * r['wait_frac']:.0f}%", str(r["staleness_max"]),
            f"{r['rollout_period_s_mean']:.3f}", f"{r['rollout_pause_s_mean']:.3f}",
            f"{r['rollout_put_s_mean']:.3f}", f"{r['load_before']:.1f}/{r['load_after']:.1f}",
        )  # fmt: skip
    console.print(table)
    target = result["target"]
    verdict = "n/a" if target["fraction"] is None else ("met" if target["met"] else "NOT met")
    m = result["machine"]
    console.print(
        f"target: speed-up at max_staleness {target['max_staleness']} >= {100 * target['min_fraction']:.0f}% "
        f"of ideal: {verdict}; load average {m['load_avg_start'][0]:.1f} -> {m['load_avg_end'][0]:.1f} "
        f"on {m['cpus']} cores"
    )


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [str(r["max_staleness"]) for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(labels, [r["s_per_step"] for r in rows], color="tab:blue")
    ax1.axhline(result["sync_s_per_step"], color="tab:red", ls="--", label="synchronous (gen + train)")
    ax1.axhline(result["ideal_s_per_step"], color="tab:green", ls="--", label="ideal (max(gen, train))")
    ax1.set(xlabel="learner.max_staleness", ylabel="s per learner step", title="step time")
    ax1.legend(fontsize=8)
    ax2.bar(labels, [100 * r["fraction_of_ideal"] for r in rows], color="tab:purple")
    ax2.axhline(100 * TARGET_FRACTION, color="k", ls=":", label=f"target {100 * TARGET_FRACTION:.0f}%")
    ax2.set(xlabel="learner.max_staleness", ylabel="% of ideal speed-up", title="achieved overlap")
    ax2.legend(fontsize=8)
    m = result["machine"]
    fig.suptitle(
        f"async overlap: workload {result['workload']} ({m['cpus']} cores, load average "
        f"{m['load_avg_start'][0]:.1f} -> {m['load_avg_end'][0]:.1f})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="sim")
    parser.add_argument(
        "--steps", type=int, default=None, help="measured steps per run (default 60, quick 4)"
    )
    parser.add_argument("--warmup", type=int, default=None, help="steps left out first (default 10, quick 2)")
    parser.add_argument("--staleness", type=int, nargs="+", default=None, help="default 0 1 2 4, quick 2")
    parser.add_argument("--repeats", type=int, default=1, help="async runs per setting (medians)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "async_overlap")
    parser.add_argument("--quick", action="store_true", help="a smoke test (< 60 s idle): not a measurement")
    parser.add_argument(
        "--override", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides on every run"
    )
    args = parser.parse_args()
    quiet_libraries()  # no transformers progress bars from the weights loaded here
    quick = args.quick
    steps = args.steps or (4 if quick else 60)
    warmup = args.warmup or (2 if quick else 10)
    staleness = args.staleness or ([TARGET_STALENESS] if quick else [0, 1, 2, 4])
    if warmup < 1:
        parser.error("--warmup must be >= 1")
    console = Console(width=170)
    with tempfile.TemporaryDirectory(prefix="sluice-async-overlap-") as tmp:
        base = WORKLOADS[args.workload]
        workload = Workload(base.name, [*base.overrides, *args.override], base.sim_generation, base.config)
        bench = AsyncOverlapBench(
            workload, steps, warmup, staleness, Path(tmp), repeats=args.repeats,
            tune_passes=1 if quick else 2, console=console,
        )  # fmt: skip
        result = bench.run()
    result["quick"] = quick
    report(result, console)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.workload}.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / f"{args.workload}.png")
    console.print(f"wrote {args.out / (args.workload + '.json')} and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
