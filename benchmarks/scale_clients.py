"""A thousand clients on one box: packed sim rollout services, 16 buffer shards, one learner.

Real processes on this machine: 16 buffer shards (`sluice buffer --shard k`), the stand-in
learner (`python -m sluice.testing.drain`: the real control plane with admission, heartbeats
and membership, and a real consumer of every shard; no model, because a trained model on these
2 cores would measure the training step, not the clients), and sim rollout services packed
many per process (`sluice rollout --index I --count N`, docs/architecture.md, "Packed sim
services"). The services join the running system in steps (64, 128, 256, 512, 1000 by
default); at each step, once every service has delivered, it measures over a window:

- aggregate samples/s consumed, per-service samples/s, and efficiency against linear scaling
  from the first step ((rate_N / N) / (rate_first / first));
- the control plane: requests/s received, the server thread's busy share, ADMIT round trips
  as services see them (their `pause_s`: admission never binds here, so it is one round trip),
  services it declared gone and heartbeats a service saw unanswered (both must be 0);
- CPU per role (psutil: user + system seconds of each process over the window, as cores):
  the shards (all, and the busiest), the learner, the packs, and the machine's other load
  (busy time in /proc/stat beyond these processes; inside a container /proc/stat may count
  only the container's own processes, and then this reads 0 whatever its neighbours do).

Sim services sleep the modelled decode time, so each service's rate is set by the latency
model: linear scaling means per-service samples/s stays while the count grows.

    python benchmarks/scale_clients.py             # 64 .. 1000 services, ~6 minutes
    python benchmarks/scale_clients.py --quick     # seconds: the smoke test runs it

Prints a table, writes JSON and a PNG (default benchmarks/results/scale_clients.{json,png}).
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from common import figure, write_config, write_report
from rich.console import Console
from rich.table import Table
from rollout_throughput import rate_in_window

from sluice.control.client import ControlClient
from sluice.metrics import read_jsonl
from sluice.net import free_port

ROOT = Path(__file__).resolve().parents[1]
console = Console()
HEARTBEAT_MISSED = b"did not answer a heartbeat"


class Cluster:
    """Shards, the stand-in learner and packs of sim services, as processes; all killed at exit."""

    def __init__(self, work: Path, shards: int, tree: dict) -> None:
        self.work = work
        tree = {
            **tree,
            "run": {"dir": str(work / "run")},
            "buffer": {
                "shards": shards,
                "endpoints": [f"tcp://127.0.0.1:{free_port()}" for _ in range(shards)],
                "capacity": 1_000_000,
            },
            "control": {"port": free_port(), **tree.get("control", {})},
        }
        self.cfg, self.config_path = write_config(work, tree)
        self.timeline = work / "drain.jsonl"
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.roles: dict[str, list[subprocess.Popen]] = {"shards": [], "learner": [], "packs": []}
        self.services = 0

    def _spawn(self, role: str, args: list[str], name: str) -> None:
        log = (self.work / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self.roles[role].append(proc)

    def start_core(self) -> None:
        for k in range(self.cfg.buffer.shards):
            self._spawn(
                "shards",
                ["-m", "sluice.cli", "buffer", str(self.config_path), "--shard", str(k)],
                f"buffer-{k}",
            )
        drain = ["-m", "sluice.testing.drain", str(self.config_path), "--out", str(self.timeline)]
        self._spawn("learner", drain, "drain")

    def grow_to(self, n: int, per_process: int) -> None:
        """Packs of at most `per_process` services until `n` run (the first pack may be smaller)."""
        while self.services < n:
            count = min(per_process, n - self.services)
            args = ["rollout", str(self.config_path), "--index", str(self.services), "--count", str(count)]
            self._spawn("packs", ["-m", "sluice.cli", *args], f"pack-{self.services}")
            self.services += count

    def check_alive(self) -> None:
        for role, procs in self.roles.items():
            for p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a {role} process exited with {p.returncode}; logs in {self.work}")

    def processes(self) -> dict[str, list[psutil.Process]]:
        return {role: [psutil.Process(p.pid) for p in procs] for role, procs in self.roles.items()}

    def heartbeats_missed(self) -> int:
        return sum(p.read_bytes().count(HEARTBEAT_MISSED) for p in self.work.glob("pack-*.log"))

    def close(self) -> None:
        every = [p for role in ("packs", "learner", "shards") for p in self.roles[role]]
        for p in every:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for p in every:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def cpu_seconds(procs: dict[str, list[psutil.Process]]) -> dict[str, list[float]]:
    """user + system seconds of each process, by role."""
    out: dict[str, list[float]] = {}
    for role, ps in procs.items():
        out[role] = []
        for p in ps:
            try:
                t = p.cpu_times()
                out[role].append(t.user + t.system)
            except psutil.NoSuchProcess:
                out[role].append(0.0)
    return out


def wait_delivered(cluster: Cluster, n: int, timeout_s: float) -> float:
    """Until the learner has seen samples of `n` services; seconds it took."""
    t0 = time.monotonic()
    while True:
        cluster.check_alive()
        recs = read_jsonl(cluster.timeline)
        if recs and recs[-1]["services"] >= n:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"only {recs[-1]['services'] if recs else 0} of {n} services delivered")
        time.sleep(0.5)


def service_batches(run_dir: Path, n: int, t0: float, t1: float) -> dict[str, float]:
    """From the batches services logged in [t0, t1]: the sum of per-service rates (each from
    its own batches: samples after its first / time from first to last, so the phases of
    services that started together do not bias it; one with fewer than two batches counts 0),
    ADMIT round trips (pause_s) and PUT times."""
    pause, put, rate = [], [], 0.0
    for i in range(n):
        mine = [r for r in read_jsonl(run_dir / "metrics" / f"rollout-{i}.jsonl") if t0 <= r["time"] <= t1]
        pause += [r["pause_s"] for r in mine]
        put += [r["put_s"] for r in mine]
        if len(mine) >= 2:
            rate += sum(r["samples"] for r in mine[1:]) / (mine[-1]["time"] - mine[0]["time"])
    if not pause:
        return {"batches": 0, "samples_per_s": 0.0}

    def q(xs: list[float], p: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] * 1000

    return {"batches": len(pause), "samples_per_s": rate,
            "admit_ms_p50": q(pause, 0.5), "admit_ms_p99": q(pause, 0.99),
            "put_ms_p50": q(put, 0.5), "put_ms_p99": q(put, 0.99)}  # fmt: skip


def measure(cluster: Cluster, control: ControlClient, n: int, window_s: float) -> dict:
    """One window at `n` services: rates, control-plane numbers and CPU per role."""
    procs = cluster.processes()
    s0, c0, m0, t0 = control.status(), cpu_seconds(procs), psutil.cpu_times(), time.time()
    time.sleep(window_s)  # the measurement window itself
    s1, c1, m1, t1 = control.status(), cpu_seconds(procs), psutil.cpu_times(), time.time()
    cluster.check_alive()
    span = t1 - t0
    consumed, samples = rate_in_window(read_jsonl(cluster.timeline), t0, t1)
    cores = {role: [(b - a) / span for a, b in zip(c0[role], c1[role])] for role in c0}
    ours = sum(sum(v) for v in cores.values())
    machine = ((m1.user + m1.system) - (m0.user + m0.system)) / span
    adm0, adm1 = s0.admission, s1.admission
    ages = [s.age_s for s in s1.services.values()]
    return {
        "services": n,
        "consumed_per_s": consumed,  # the learner's intake (its steps inside the window)
        "consumed": samples,
        "members": sum(sid.startswith("rollout-") for sid in s1.services),
        "services_gone": adm1["services_gone"],
        "heartbeat_age_max_s": max(ages, default=0.0),
        "heartbeats_missed": cluster.heartbeats_missed(),
        "control_requests_per_s": (adm1["requests"] - adm0["requests"]) / span,
        "control_busy": (adm1["serve_s"] - adm0["serve_s"]) / span,
        **service_batches(cluster.cfg.run_dir, n, t0, t1),
        "cpu_cores": {
            "shards": sum(cores["shards"]),
            "busiest_shard": max(cores["shards"]),
            "learner": sum(cores["learner"]),
            "packs": sum(cores["packs"]),
            "other_load": max(0.0, machine - ours),
        },
        "packs": len(procs["packs"]),
        "packs_rss_mib": sum(p.memory_info().rss for p in procs["packs"]) / 2**20,
        "load_avg": os.getloadavg(),
    }


def bench(counts: list[int], args: argparse.Namespace, tree: dict, work: Path, ideal: float) -> list[dict]:
    cluster = Cluster(work, args.shards, tree)
    rows = []
    try:
        cluster.start_core()
        control = ControlClient(cluster.cfg.control.endpoint, timeout_s=30)
        for n in counts:
            cluster.grow_to(n, args.per_process)
            took = wait_delivered(cluster, n, timeout_s=60 + n / 10)
            time.sleep(args.warmup_s)  # every new service past its first batches
            row = measure(cluster, control, n, args.window_s)
            row["join_s"] = took
            rows.append(row)
            console.print(
                f"  {n:5d} services: {row['samples_per_s']:8.1f} samples/s, "
                f"{row['control_requests_per_s']:.0f} control req/s, cpu {row['cpu_cores']}"
            )
        control.close()
    finally:
        cluster.close()
    base = (
        rows[0]["samples_per_s"] / rows[0]["services"] if rows and rows[0]["samples_per_s"] else float("nan")
    )
    for r in rows:
        r["per_service"] = r["samples_per_s"] / r["services"]
        r["efficiency"] = r["per_service"] / base
        r["of_ideal"] = r["per_service"] / ideal
    return rows


def workload(quick: bool) -> dict:
    """The run config: each service makes one batch of 8 samples per 10 s (sim latency), so
    that a thousand fit in 2 cores with the shards and the learner."""
    sim = {"call_s": 0.4, "prefill_s_per_token": 0.0, "decode_step_s": 1.2, "decode_s_per_seq": 0.0,
           "eos_prob": 0.0}  # fmt: skip
    batch = 16 if quick else 128
    if quick:
        sim = {**sim, "call_s": 0.05, "decode_step_s": 0.1}
    return {
        "model": {"init": {"vocab": "digits", "max_position_embeddings": 64}},
        "task": {"name": "copy", "params": {"length": 3}},
        "control": {"heartbeat_s": 2.0, "service_timeout_s": 30.0},
        "rollout": {
            "engine": "sim",
            "services": 1,
            "group_size": 8,
            "prompts_per_batch": 1,
            "max_new_tokens": 8,
            "sim": sim,
        },  # fmt: skip
        # admission on; the bound is loose so that the learner side never throttles
        "learner": {"batch_size": batch, "max_staleness": 1000},
        "metrics": {"tensorboard": False},
    }


def report(result: dict) -> None:
    t = Table(title=f"packed sim services, {result['shards']} shards, stand-in learner (drain)")
    cols = ("services", "packs", "samples/s", "consumed/s", "per service", "vs linear", "of ideal",
            "ctl req/s", "ctl busy", "admit p50/p99 ms", "gone", "hb missed", "cores: shards (max)",
            "learner", "packs", "other")  # fmt: skip
    for col in cols:
        t.add_column(col, justify="right")
    for r in result["rows"]:
        c = r["cpu_cores"]
        t.add_row(
            str(r["services"]),
            str(r["packs"]),
            f"{r['samples_per_s']:.1f}",
            f"{r['consumed_per_s']:.1f}",
            f"{r['per_service']:.3f}",
            f"{100 * r['efficiency']:.1f}%",
            f"{100 * r['of_ideal']:.1f}%",
            f"{r['control_requests_per_s']:.0f}",
            f"{100 * r['control_busy']:.1f}%",
            f"{r.get('admit_ms_p50', float('nan')):.1f}/{r.get('admit_ms_p99', float('nan')):.1f}",
            f"{r['services_gone']:.0f}",
            str(r["heartbeats_missed"]),
            f"{c['shards']:.2f} ({c['busiest_shard']:.2f})",
            f"{c['learner']:.2f}",
            f"{c['packs']:.2f}",
            f"{c['other_load']:.2f}",
        )
    console.print(t)
    m = result["machine"]
    console.print(
        f"ideal per service {result['ideal_per_service']:.3f} samples/s; "
        f"load average start {m['load_avg_start']}, end {m['load_avg_end']}"
    )


def plot(result: dict, path: Path) -> None:
    rows = result["rows"]
    n = [r["services"] for r in rows]
    with figure(path, ncols=2, size=(12, 4.5)) as (ax_rate, ax_cpu):
        ax_rate.plot(n, [r["samples_per_s"] for r in rows], "o-", label="measured")
        linear = rows[0]["samples_per_s"] / rows[0]["services"]
        ax_rate.plot(n, [linear * x for x in n], "--", label="linear from the first step")
        ax_rate.set(xlabel="sim rollout services", ylabel="samples/s (sum over services)")
        ax_rate.set_title("aggregate throughput")
        ax_rate.legend()
        bottom = [0.0] * len(rows)
        for role in ("packs", "shards", "learner", "other_load"):
            vals = [r["cpu_cores"][role] for r in rows]
            ax_cpu.bar([str(x) for x in n], vals, bottom=bottom, label=role)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax_cpu.axhline(result["machine"]["cpus"], color="k", lw=0.8)
        ax_cpu.set(xlabel="sim rollout services", ylabel="cores", title="CPU per role (the line: all cores)")
        ax_cpu.legend()


def main() -> int:
    parser = argparse.ArgumentParser(description="a thousand packed sim rollout services on one machine")
    parser.add_argument("--counts", default="64,128,256,512,1000", help="service counts, in order")
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--per-process", type=int, default=128, help="most services per pack process")
    parser.add_argument("--window-s", type=float, default=35.0, help="measurement window per count")
    parser.add_argument("--warmup-s", type=float, default=5.0, help="wait after every service delivered")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, not a measurement")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    counts = [int(x) for x in args.counts.split(",")]
    if args.quick:
        counts, args.shards, args.per_process, args.window_s, args.warmup_s = [4, 8], 2, 4, 4.0, 1.0
    tree = workload(args.quick)
    sim, rc = tree["rollout"]["sim"], tree["rollout"]
    batch_s = sim["call_s"] + rc["max_new_tokens"] * sim["decode_step_s"]
    result: dict = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_avg_start": os.getloadavg(),
        },
        "shards": args.shards,
        "per_process": args.per_process,
        "window_s": args.window_s,
        "config": tree,
        "ideal_per_service": rc["group_size"] * rc["prompts_per_batch"] / batch_s,
    }
    with tempfile.TemporaryDirectory(prefix="sluice-scale-") as tmp:
        result["rows"] = bench(counts, args, tree, Path(tmp), result["ideal_per_service"])
    result["machine"]["load_avg_end"] = os.getloadavg()
    report(result)
    write_report(console, args.out, "scale_clients", result, lambda p: plot(result, p))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
