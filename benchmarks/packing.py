"""Sequence packing against right-padding: the learner's own training step (`Trainer.train_step`:
collate, plan, forward, loss, backward, clip, AdamW) on the vs_trl workload's model and batch,
packed and padded, in one process (docs/architecture.md, "Sequence packing").

Two trainers of the same config and initial weights, one with `learner.pack_sequences=false`,
train the same batches in alternating order (ABBA, so drift over the run hits both alike), on
one torch thread as the learner has beside the rollouts on 2 cores, keeping freed memory as a
learner process does (`sluice.launch.heap.retain_freed_memory`). A batch is 8 prompts x 8
completions of the copy task; completion lengths are drawn from a distribution per row of the
table, each a phase of a vs_trl run:
- `stopping-unlearnt`: 1-12 tokens, geometric with mean ~8 (a policy that rarely samples its
  end-of-sequence token: the first ~40% of a run);
- `mostly-stopping`: 4 tokens (3 digits and the end), a tenth of the rows at 12 (the climb);
- `all-stopping`: 4 tokens everywhere (every row as wide as the widest: nothing to pack);
- `plateau`: every row truncated at 12 (the copy task's 0.75 plateau: nothing to pack).
Reported per distribution: the median step (wall and the thread's CPU time) of each, and
packed / padded. Writes a table, <out>/packing.json and <out>/packing.png.

    .venv/bin/python benchmarks/packing.py [--rounds 30] [--out DIR] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import figure, write_report  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402
from rich.table import Table  # noqa: E402

PROMPTS, GROUP, MAX_NEW = 8, 8, 12
DISTRIBUTIONS = ("stopping-unlearnt", "mostly-stopping", "all-stopping", "plateau")


def completion_lengths(name: str, rng: np.random.Generator) -> np.ndarray:
    n = PROMPTS * GROUP
    if name == "stopping-unlearnt":
        return np.minimum(rng.geometric(1 / 8, n), MAX_NEW)
    if name == "mostly-stopping":
        return np.where(rng.random(n) < 0.1, MAX_NEW, 4)
    return np.full(n, 4 if name == "all-stopping" else MAX_NEW)


def batch(name: str, rng: np.random.Generator, tokenizer, task) -> list:
    """One step's trajectories: the copy task's prompts, random completion tokens and rewards."""
    from sluice.trajectory import Trajectory

    lengths = completion_lengths(name, rng)
    prompts = [[tokenizer.bos_token_id, *tokenizer.encode(p.text, add_special_tokens=False)] for p in task]
    return [
        Trajectory(
            traj_id=f"t{i}",
            group_id=f"g{i // GROUP}",
            version=0,
            group_size=GROUP,
            reward=float(rng.random()),
            arrays={
                "prompt_ids": np.asarray(prompts[i // GROUP], np.int32),
                "completion_ids": rng.integers(4, len(tokenizer), n).astype(np.int32),
                "behaviour_logprobs": rng.uniform(-3, -1, n).astype(np.float32),
            },
        )
        for i, n in enumerate(lengths)
    ]


def trainers(work: Path):
    """(padded, packed) Trainers of the vs_trl workload's model, config and optimiser."""
    import torch
    import vs_trl

    from sluice.config import load_config
    from sluice.launch.heap import retain_freed_memory
    from sluice.learner.dist import DistContext
    from sluice.learner.trainer import Trainer

    torch.set_num_threads(1)
    retain_freed_memory()  # as every learner process does
    model_dir = work / "model"
    vs_trl.build_model_dir(model_dir)
    spec = {"seed": 0, "model_dir": model_dir, "task": "copy", "group": GROUP, "max_steps": 1000}
    base = vs_trl.sluice_overrides(spec, work / "run")
    config = ROOT / "configs" / "quickstart.yaml"
    out = []
    for pack in ("false", "true"):
        torch.manual_seed(0)
        cfg = load_config(config, [*base, f"learner.pack_sequences={pack}"])
        out.append(Trainer(cfg, DistContext(), model_dir))
    assert out[1].objective.pack_attention is not None, "the workload's model should pack"
    return out


def timed(trainer, trajs) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.thread_time()
    trainer.train_step(trajs)
    return time.perf_counter() - wall, time.thread_time() - cpu


def measure(name: str, rounds: int, warmup: int, pair, tokenizer, task_prompts, progress) -> dict:
    rng = np.random.default_rng(DISTRIBUTIONS.index(name))
    times: dict[str, list[tuple[float, float]]] = {"padded": [], "packed": []}
    bar = progress.add_task(name, total=warmup + rounds)
    for r in range(warmup + rounds):
        trajs = batch(name, rng, tokenizer, task_prompts)
        order = [("padded", pair[0]), ("packed", pair[1])]
        for label, trainer in order if r % 2 == 0 else order[::-1]:
            t = timed(trainer, trajs)
            if r >= warmup:
                times[label].append(t)
        progress.advance(bar)
    med = {
        k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()
    }
    packed_rows = pair[1].objective.prepare(pair[1].model, trajs, pair[1].dist).batch.packed
    return {
        "distribution": name,
        "padded_s": med["padded"][0],
        "packed_s": med["packed"][0],
        "padded_cpu_s": med["padded"][1],
        "packed_cpu_s": med["packed"][1],
        "ratio": med["packed"][0] / med["padded"][0],
        "cpu_ratio": med["packed"][1] / med["padded"][1],
        "padded_shape": [
            len(trajs),
            int(max(len(t.arrays["prompt_ids"]) + len(t.arrays["completion_ids"]) for t in trajs)),
        ],
        "packed_shape": list(packed_rows.input_ids.shape) if packed_rows is not None else None,
    }


def table(rows: list[dict]) -> Table:
    t = Table(title="Learner step, packed against padded (medians; the same batches, alternating)")
    for col in (
        "distribution",
        "padded s",
        "packed s",
        "packed / padded",
        "CPU packed / padded",
        "rows x width",
    ):
        t.add_column(col)
    for r in rows:
        shape = "not packed" if r["packed_shape"] is None else "{} x {}".format(*r["packed_shape"])
        t.add_row(
            r["distribution"], f"{r['padded_s']:.4f}", f"{r['packed_s']:.4f}", f"{r['ratio']:.2f}",
            f"{r['cpu_ratio']:.2f}", f"{shape} of {r['padded_shape'][0]} x {r['padded_shape'][1]}",
        )  # fmt: skip
    return t


def plot(rows: list[dict]):
    def draw(path: Path) -> None:
        with figure(path, size=(8, 4.5)) as (ax,):
            x = np.arange(len(rows))
            ax.bar(x - 0.2, [r["padded_s"] * 1e3 for r in rows], 0.4, label="padded")
            ax.bar(x + 0.2, [r["packed_s"] * 1e3 for r in rows], 0.4, label="packed")
            ax.set_xticks(x, [r["distribution"] for r in rows])
            ax.set_ylabel("learner step, ms (median)")
            ax.set_title("Sequence packing on the vs_trl workload (64 sequences, 1 thread)")
            ax.legend()

    return draw


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "packing")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 rounds after 1 of warm-up")
    args = p.parse_args()
    rounds, warmup = (2, 1) if args.quick else (args.rounds, args.warmup)
    console = Console()
    import vs_trl

    with tempfile.TemporaryDirectory() as work:
        pair = trainers(Path(work))
        tokenizer = pair[0].tokenizer
        prompts = vs_trl.make_task("copy", 0).sample(PROMPTS)
        with Progress(console=console) as progress:
            rows = [measure(n, rounds, warmup, pair, tokenizer, prompts, progress) for n in DISTRIBUTIONS]
    console.print(table(rows))
    payload = {"rounds": rounds, "warmup": warmup, "threads": 1, "batch": PROMPTS * GROUP, "rows": rows}
    write_report(console, args.out, "packing", payload, plot(rows))


if __name__ == "__main__":
    main()
