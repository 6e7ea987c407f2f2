"""Buffer throughput: PUT + GET + ACK through 1 and N shards, against two baselines run alongside.

For each trajectory size, in the same run:
- raw ZeroMQ PUSH -> PULL over tcp loopback moving the same bytes (one message per trajectory,
  zero-copy send): the ceiling for anything built on ZeroMQ;
- raw ZeroMQ PUSH -> relay process -> PULL: the same bytes over the same topology as a buffer
  (producer -> shard -> consumer, two hops through a middle process), with no buffer logic:
  the ceiling for any buffer that is its own process;
- ray.util.queue.Queue (an actor-backed queue, what verl and OpenRLHF use) moving numpy arrays
  of the same size from a Ray task to the driver;
- Sluice: a producer process PUTs (batched; up to `--put-window` PUT messages in flight, a
  PutPipeline), the consumer (this process) GETs and ACKs (each batch with its next GET;
  `--separate-ack`: an ACK request of its own), with
  shard processes writing their durable log (fsync policy `--fsync`, default none), over each
  transport (`--transports`): `zmq` (every byte in ZeroMQ frames) and `same-host` (the
  producer writes the arrays into space it reserved in the shard's segment file, the consumer
  maps the files and gets views; ZeroMQ carries headers only). The consumer does not read the
  arrays it gets (neither does the raw ZeroMQ receiver); `--extra-256kb` adds runs where it
  reads every byte (xxh3), the price a learner pays when it collates.
Throughput is trajectories (and payload MB) per second, measured after a warm-up (as for the
baselines): for Sluice, enough data for each shard's log to go round twice (the first
compaction sizes the pool of retired files kept for reuse, the second round writes into
them: the steady state of a long run; `SHARD_LOG`, `SHARD_QUEUE_BYTES` below).
CPU s/GB is the CPU time (user + system) of every process of the case (sender/producer,
relay/shards, receiver/consumer) per GB moved: unlike throughput it hardly depends on what
else loads the machine. Then one shard is filled to capacity to measure its memory (RSS).

`--netns` (root; `ip netns`) adds the cases again between two addresses: two network
namespaces joined by veth pairs on a bridge (sluice/testing/netns.py), the producer, the
consumer and the raw ZeroMQ receiver in one, the shards, the relay and the raw sender in the
other, so every byte crosses veth, bridge and veth as it would between hosts, not loopback.
They show as `... over veth` beside raw ZeroMQ and the relay between the same two addresses
("vs raw", "vs relay" compare with those), Sluice with every byte in ZeroMQ frames: what a
client on another host uses (the namespaces still share one filesystem, so `auto` would find
the shards' files and share memory).

    python benchmarks/buffer_throughput.py            # several minutes
    python benchmarks/buffer_throughput.py --quick    # seconds, no steady-state warm-up (the smoke test)
    python benchmarks/buffer_throughput.py --quick --netns --no-ray --transports zmq

Prints a table and writes JSON (default benchmarks/results/buffer_throughput.json).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import platform
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import psutil
import zmq
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from sluice.testing.netns import Lab

KB = 1024
MB = 1024 * 1024
SIZE_NAMES = {"1KB": KB, "16KB": 16 * KB, "256KB": 256 * KB, "4MB": 4 * MB}
SHARD_LOG = {"compact_min_bytes": 128 * MB, "segment_bytes": 32 * MB}  # log settings of the shards
# What a shard may hold (buffer.capacity_bytes): a few learner batches, as in a run. The producer
# keeps it full, so the log compacts at twice this (compact_ratio 2) and copies it.
SHARD_QUEUE_BYTES = 256 * MB


TRANSPORTS = {"zmq": "zmq", "same-host": "auto"}  # name in the table -> buffer.same_host_transport
VETH = "veth"  # Case.link of the cases between two network namespaces (--netns)
NETNS_PORTS = itertools.count(20000)  # ports in the --netns namespaces, where nothing else listens


@dataclass
class Case:
    system: str  # raw_zmq | raw_zmq_relay | ray_queue | sluice
    shards: int
    size: int
    n: int
    seconds: float
    batch: int = 1
    note: str = ""
    cpu_s: float | None = None  # CPU time of every process of the case (None: not measured)
    log_amplification: float = 0.0  # sluice: bytes written to the log (all of it) / payload bytes PUT
    compacted_share: float = 0.0  # sluice: of which compaction's copies
    transport: str = ""  # sluice: zmq | same-host
    shared_fraction: float = 0.0  # sluice: share of trajectories that went through shared memory
    cpu_roles: dict[str, float] = field(default_factory=dict)  # sluice: CPU s/GB of each role
    mb_per_s_runs: list[float] = field(default_factory=list)  # every run's MB/s (with --repeat)
    link: str = ""  # "": over loopback; "veth": between two network namespaces (--netns)

    @property
    def name(self) -> str:
        name = self.system if not self.transport else f"{self.system} {self.transport}"
        name = name if not self.note else f"{name} ({self.note})"
        return name if not self.link else f"{name} over {self.link}"

    @property
    def trajs_per_s(self) -> float:
        return self.n / self.seconds

    @property
    def mb_per_s(self) -> float:
        return self.n * self.size / self.seconds / MB

    @property
    def cpu_s_per_gb(self) -> float | None:
        return None if self.cpu_s is None else self.cpu_s / (self.n * self.size / (1 << 30))


@dataclass
class MemoryPoint:
    size: int
    transport: str
    capacity: int
    held_bytes: int
    rss_empty: int
    rss_full: int

    @property
    def overhead(self) -> float:
        return (self.rss_full - self.rss_empty) / max(1, self.held_bytes)


@dataclass
class Results:
    cases: list[Case] = field(default_factory=list)
    memory: list[MemoryPoint] = field(default_factory=list)
    machine: dict = field(default_factory=dict)


# -- helpers ------------------------------------------------------------------------------------


def count_for(size: int, budget_bytes: int, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, budget_bytes // size)))


def put_batch_for(size: int) -> int:
    """Trajectories per PUT: about 4 MB per message, at most 256."""
    return int(max(1, min(256, (4 * MB) // size)))


def free_endpoint() -> str:
    from sluice.net import free_port

    return f"tcp://127.0.0.1:{free_port()}"


def endpoint_at(across: Lab | None, label: str) -> str:
    """A free endpoint on loopback, or (`across`) at the address of the lab's host `label`."""
    if across is None:
        return free_endpoint()
    return f"tcp://{across[label].addr}:{next(NETNS_PORTS)}"


def netns_of(across: Lab | None, label: str) -> str | None:
    """The namespace a process of host `label` enters first thing (None: where it starts)."""
    return None if across is None else across[label].netns


def enter_netns(netns: str | None) -> None:
    """A spawned process's first step: into its host's namespace (--netns), before any socket."""
    if netns is not None:
        from sluice.testing.netns import enter

        enter(netns)


class CpuMeter:
    """CPU time (user + system, threads included) of this process and the given children."""

    def __init__(self, pids: list[int]) -> None:
        self.procs = [psutil.Process()] + [psutil.Process(p) for p in pids]
        self.start = self._now()

    def _now(self) -> list[float]:
        out = []
        for p in self.procs:
            try:
                t = p.cpu_times()
                out.append(t.user + t.system)
            except psutil.NoSuchProcess:
                out.append(float("nan"))
        return out

    def used(self) -> float:
        return sum(self.each())

    def each(self) -> list[float]:
        """CPU seconds of each process since the start: this one first, then the given pids."""
        return [b - a for a, b in zip(self.start, self._now())]


# -- raw ZeroMQ --------------------------------------------------------------------------------


def _raw_sender(endpoint: str, size: int, n: int, netns: str | None = None) -> None:
    enter_netns(netns)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.connect(endpoint)
    payload = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    for _ in range(n):
        sock.send(payload, copy=False)
    sock.close(linger=-1)
    ctx.term()


def _raw_relay(bind_in: str, connect_out: str, n: int, netns: str | None = None) -> None:
    enter_netns(netns)
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (pull, push):
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.setsockopt(zmq.RCVHWM, 1000)
    pull.bind(bind_in)
    push.connect(connect_out)
    for _ in range(n):
        push.send(pull.recv(copy=False), copy=False)
    pull.close()
    push.close(linger=-1)
    ctx.term()


def bench_raw_zmq(size: int, n: int, relay: bool = False, across: Lab | None = None) -> Case:
    """Raw ZeroMQ into this process, from a sender or through a relay. `across` (the calling
    thread in its client namespace): the sender, or the relay, in the shards' namespace."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 1000)
    sock.setsockopt(zmq.LINGER, 0)
    endpoint = endpoint_at(across, "client")
    sock.bind(endpoint)
    warm = max(1, n // 20)
    ctx_mp = mp.get_context("spawn")
    far = netns_of(across, "shards")
    procs = [ctx_mp.Process(target=_raw_sender, args=(endpoint, size, n + warm, far))]
    if relay:
        relay_in = endpoint_at(across, "shards")
        procs = [
            ctx_mp.Process(target=_raw_relay, args=(relay_in, endpoint, n + warm, far)),
            ctx_mp.Process(target=_raw_sender, args=(relay_in, size, n + warm)),
        ]
    for p in procs:
        p.start()
    try:
        for _ in range(warm):
            if not sock.poll(60_000):
                raise TimeoutError("raw zmq: sender silent")
            sock.recv(copy=False)
        meter = CpuMeter([p.pid for p in procs])
        t0 = time.perf_counter()
        for _ in range(n):
            if not sock.poll(60_000):
                raise TimeoutError("raw zmq: sender silent")
            sock.recv(copy=False)
        seconds = time.perf_counter() - t0
        cpu = meter.used()
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        sock.close()
        ctx.term()
    name = "raw_zmq_relay" if relay else "raw_zmq"
    return Case(name, 0, size, n, seconds, cpu_s=cpu, link=VETH if across else "")


# -- Ray queue ---------------------------------------------------------------------------------


class RayBaseline:
    def __init__(self) -> None:
        import ray

        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        self.ray = ray

    def run(self, size: int, n: int) -> Case:
        from ray.util.queue import Queue

        ray = self.ray
        queue = Queue(maxsize=64)

        @ray.remote
        def produce(q, size: int, n: int) -> int:
            payload = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
            for _ in range(n):
                q.put(payload)
            return n

        warm = max(1, n // 20)
        ref = produce.remote(queue, size, n + warm)
        for _ in range(warm):
            queue.get(timeout=120)
        t0 = time.perf_counter()
        for _ in range(n):
            queue.get(timeout=120)
        seconds = time.perf_counter() - t0
        ray.get(ref, timeout=120)
        queue.shutdown()
        return Case("ray_queue", 0, size, n, seconds)

    def close(self) -> None:
        self.ray.shutdown()


# -- Sluice ------------------------------------------------------------------------------------


def _shard_main(
    cfg_json: str, shard: int, log_dir: str | None, ready, stop, netns: str | None = None
) -> None:
    enter_netns(netns)
    from sluice.buffer.server import ShardServer
    from sluice.config.buffer import BufferConfig

    cfg = BufferConfig.model_validate_json(cfg_json)
    server = ShardServer(cfg, shard, log_dir=Path(log_dir) if log_dir else None)
    stop_flag = threading.Event()
    threading.Thread(target=lambda: (stop.wait(), stop_flag.set()), daemon=True).start()
    ready.set()
    server.serve(stop_flag)


def warmup_count(size: int, shards: int, n: int) -> int:
    """Trajectories pushed through before timing: two rounds of each shard's log (bounded)."""
    cycle = max(SHARD_LOG["compact_min_bytes"], 2 * SHARD_QUEUE_BYTES) + 2 * SHARD_LOG["segment_bytes"]
    return int(min(20000, max(n // 20, 2 * cycle * shards // size)))


def _producer_main(
    endpoints: list[str],
    same_host: str,
    size: int,
    n: int,
    batch: int,
    window: int,
    ready,
    go,
    done,
    shared,
    release,
) -> None:
    from sluice.buffer.client import BufferClient
    from sluice.trajectory import Trajectory

    # One buffer, a distinct view of it per trajectory (as a rollout's arrays are distinct):
    # no copies, and numpy does not pile up buffer exports on one shared array.
    block = np.random.default_rng(0).integers(0, 255, size * batch, dtype=np.uint8)
    views = [block[j * size : (j + 1) * size] for j in range(batch)]
    run = uuid.uuid4().hex[:8]
    with BufferClient(endpoints, timeout_s=60, put_give_up_s=300, same_host=same_host) as client:
        client.ping(timeout_s=30)  # connected (and, same host, shared) before the clock starts
        ready.set()
        go.wait()
        with client.pipeline(window) as pipe:
            for start in range(0, n, batch):
                trajs = [
                    Trajectory(
                        traj_id=f"{run}-{i}", group_id=f"{run}-{i}", version=0, arrays={"x": views[i - start]}
                    )
                    for i in range(start, min(n, start + batch))
                ]
                pipe.put(trajs)
        shared.value = client.shared_put_bytes
    done.set()
    release.wait(120)  # alive until the consumer has read this process's CPU time


class ShardFleet:
    """N shard processes with their own logs in a temporary directory."""

    def __init__(
        self,
        shards: int,
        fsync: str,
        durable: bool,
        capacity: int,
        capacity_bytes: int,
        transport: str = "zmq",
        across: Lab | None = None,
    ) -> None:
        from sluice.config.buffer import BufferConfig

        self.tmp = Path(tempfile.mkdtemp(prefix="sluice-bench-"))
        self.cfg = BufferConfig(
            shards=shards,
            endpoints=[endpoint_at(across, "shards") for _ in range(shards)],
            fsync=fsync,
            durable=durable,
            capacity=capacity,
            capacity_bytes=capacity_bytes,
            log_dir=str(self.tmp),
            same_host_transport=TRANSPORTS[transport],
            **SHARD_LOG,
        )
        ctx = mp.get_context("spawn")
        self.stop = ctx.Event()
        self.procs = []
        for k in range(shards):
            ready = ctx.Event()
            log_dir = str(self.cfg.shard_log_dir(k, None)) if durable else None
            args = (self.cfg.model_dump_json(), k, log_dir, ready, self.stop, netns_of(across, "shards"))
            p = ctx.Process(target=_shard_main, args=args)
            p.start()
            if not ready.wait(60):
                raise TimeoutError(f"shard {k} did not start")
            self.procs.append(p)

    def close(self) -> None:
        self.stop.set()
        for p in self.procs:
            p.join(timeout=15)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(self.tmp, ignore_errors=True)


def bench_sluice(
    shards: int,
    size: int,
    n: int,
    fsync: str,
    durable: bool = True,
    transport: str = "zmq",
    reads: bool = False,
    window: int = 2,
    ack_with_get: bool = True,
    across: Lab | None = None,
    steady: bool = True,
) -> Case:
    """PUT + GET + ACK through `shards` shard processes. `reads`: the consumer reads every byte.
    `across` (the calling thread in its client namespace): the shards in the other namespace.
    `steady`: warm up to the logs' steady state first (else four PUTs a shard: --quick)."""
    import xxhash

    from sluice.buffer.client import BufferClient

    batch = put_batch_for(size)
    capacity = max(4 * batch * shards, 4096)
    fleet = ShardFleet(
        shards,
        fsync,
        durable,
        capacity=capacity,
        capacity_bytes=max(SHARD_QUEUE_BYTES, 8 * batch * size),
        transport=transport,
        across=across,
    )
    ctx = mp.get_context("spawn")
    ready, go, done, release = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Event()
    shared_bytes = ctx.Value("q", 0)
    # Durable, or sharing memory-backed segments: reach the steady state of segment reuse first.
    cycled = steady and (durable or transport == "same-host")
    # --quick: four PUTs a shard, past the first ones (with a twentieth of n, 2.5% of one same-host
    # shard's 1 KB trajectories went as frames).
    quick_warm = max(n // 20, 4 * batch * shards)
    warm = warmup_count(size, shards, n) if cycled else max(1, n // 20) if steady else quick_warm
    total = warm + n
    same_host = TRANSPORTS[transport]
    producer = ctx.Process(
        target=_producer_main,
        args=(
            fleet.cfg.endpoints,
            same_host,
            size,
            total,
            batch,
            window,
            ready,
            go,
            done,
            shared_bytes,
            release,
        ),
    )
    producer.start()
    try:
        with BufferClient(fleet.cfg.endpoints, timeout_s=60, same_host=same_host) as client:
            got = 0
            client.ping(timeout_s=30)
            if not ready.wait(120):
                raise TimeoutError("producer did not start")
            go.set()
            idle_since = time.monotonic()
            meter, t0, counted_from = None, 0.0, 0
            used = None
            while got < total:
                if meter is None and got >= warm:
                    meter, t0, counted_from = (
                        CpuMeter([producer.pid] + [p.pid for p in fleet.procs]),
                        time.perf_counter(),
                        got,
                    )
                # (the batch used up is ACKed with the next GET: one round trip for both)
                leased = client.get(2 * batch, wait_ms=200, ack=used if ack_with_get else None)
                if used is not None and not ack_with_get:
                    client.ack(used)
                used = None
                if leased.trajs:
                    got += len(leased.trajs)
                    if reads:
                        for t in leased.trajs:
                            xxhash.xxh3_64_intdigest(t.arrays["x"])
                    used = leased
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > 60:
                    raise TimeoutError(f"sluice: no data for 60 s after {got}/{total}")
            client.ack(used)
            seconds = time.perf_counter() - t0
            each = meter.each()
            release.set()
            cpu = sum(each)
            n = got - counted_from
            shared_got = client.shared_get_trajs
            gb = n * size / (1 << 30)
            stats = [r.stats for r in client.stats()]
            written = sum(
                st.get(k, 0) for st in stats for k in ("log_written_bytes", "compacted_bytes", "region_bytes")
            )
            compacted = sum(st.get("compacted_bytes", 0) for st in stats)
            roles = {"consumer": each[0] / gb, "producer": each[1] / gb, "shards": sum(each[2:]) / gb}
        producer.join(timeout=60)
    finally:
        release.set()
        if producer.is_alive():
            producer.kill()
        fleet.close()
    note = f"log, fsync={fsync}" if durable else "no log"
    if reads:
        note += ", consumer reads"
    shared = min(shared_got / total, shared_bytes.value / (total * size))
    return Case(
        "sluice",
        shards,
        size,
        n,
        seconds,
        batch=batch,
        note=note,
        cpu_s=cpu,
        transport=transport,
        shared_fraction=shared,
        cpu_roles=roles,
        log_amplification=written / (total * size),
        compacted_share=compacted / max(1, written),
        link=VETH if across else "",
    )


def bench_across(lab: Lab, size: int, n: int, shard_counts: list[int], fsync: str, opts: dict) -> list[Case]:
    """The --netns cases: raw ZeroMQ and the relay between the lab's two namespaces, then Sluice
    (every byte in ZeroMQ frames, as for a client on another host) with each shard count. This
    thread is in the client namespace meanwhile: the consumer, and the processes it starts
    (producer, raw sender behind a relay), are there; shards, relay and raw sender enter theirs."""
    from sluice.testing.netns import inside

    with inside(lab["client"].netns):
        cases = [bench_raw_zmq(size, n, across=lab), bench_raw_zmq(size, n, relay=True, across=lab)]
        for shards in shard_counts:
            cases.append(bench_sluice(shards, size, n, fsync, transport="zmq", across=lab, **opts))
    return cases


def open_lab(enabled: bool) -> Lab | None:
    """The two namespaces of --netns (client, shards), or None without it; exits with the
    reason when they cannot be made here."""
    if not enabled:
        return None
    from sluice.testing.netns import Lab, unavailable

    reason = unavailable()
    if reason is not None:
        raise SystemExit(f"--netns: {reason}")
    return Lab(["client", "shards"])


def measure_memory(size: int, capacity: int, transport: str = "zmq") -> MemoryPoint:
    """Fill one shard to capacity; RSS of the shard process before and after. (Same host, the
    payload lies in the shard's segment files, i.e. the page cache: RSS counts the pages the
    shard mapped, once it read them to check their checksum.)"""
    from sluice.buffer.client import BufferClient, BufferError
    from sluice.trajectory import Trajectory

    fleet = ShardFleet(
        1, "none", True, capacity=capacity, capacity_bytes=capacity * size + MB, transport=transport
    )
    try:
        proc = psutil.Process(fleet.procs[0].pid)
        time.sleep(0.5)
        rss_empty = proc.memory_info().rss
        payload = np.zeros(size, dtype=np.uint8)
        batch = put_batch_for(size)
        run = uuid.uuid4().hex[:8]
        with BufferClient(
            fleet.cfg.endpoints, timeout_s=60, put_give_up_s=0.5, same_host=TRANSPORTS[transport]
        ) as client:
            client.ping(timeout_s=30)
            i = 0
            while i < capacity:
                trajs = [
                    Trajectory(traj_id=f"{run}-{j}", group_id=f"{run}-{j}", version=0, arrays={"x": payload})
                    for j in range(i, min(capacity, i + batch))
                ]
                client.put(trajs)
                i += len(trajs)
            try:
                client.put([Trajectory(traj_id="over", group_id="over", version=0, arrays={"x": payload})])
                raise AssertionError("a full shard accepted one more trajectory")
            except BufferError as e:
                assert e.code == "FULL", e
            held = client.stats()[0].stats["held_bytes"]
            time.sleep(0.3)
            rss_full = proc.memory_info().rss
    finally:
        fleet.close()
    return MemoryPoint(size, transport, capacity, held, rss_empty, rss_full)


# -- report ------------------------------------------------------------------------------------


def size_name(size: int) -> str:
    return next((k for k, v in SIZE_NAMES.items() if v == size), f"{size}B")


def progress(console: Console, c: Case) -> None:
    roles = ", ".join(f"{k} {v:.2f}" for k, v in c.cpu_roles.items())
    console.print(
        f"  {c.name}, {c.shards} shard(s): {c.mb_per_s:,.1f} MB/s, {c.cpu_s_per_gb:.2f} CPU s/GB "
        f"({roles}), shared {c.shared_fraction:.0%}, log writes {c.log_amplification:.2f}x payload "
        f"({c.compacted_share:.0%} compaction)"
    )


def medians(runs: list[Case]) -> list[Case]:
    """For each case measured several times, the run with the median throughput (its own CPU
    figures), with every run's MB/s kept in `mb_per_s_runs`."""
    by_case: dict[tuple, list[Case]] = {}
    for c in runs:
        by_case.setdefault((c.name, c.shards, c.size), []).append(c)
    out = []
    for same in by_case.values():
        ordered = sorted(same, key=lambda c: c.mb_per_s)
        median = ordered[(len(ordered) - 1) // 2]
        median.mb_per_s_runs = [round(c.mb_per_s, 1) for c in same]
        out.append(median)
    return out


def report(results: Results, console: Console) -> None:
    by_size: dict[int, dict[str, Case]] = {}
    for c in results.cases:
        by_size.setdefault(c.size, {})[f"{c.name}/{c.shards}"] = c
    table = Table(title="Buffer throughput: PUT + GET + ACK (sluice) vs raw ZeroMQ and Ray queue")
    cols = (
        "size",
        "system",
        "shards",
        "batch",
        "trajs/s",
        "MB/s",
        "vs raw",
        "vs relay",
        "vs ray",
        "CPU s/GB",
    )
    for col in cols:
        table.add_column(col, justify="left" if col == "system" else "right")
    for size in sorted(by_size):
        cases = by_size[size]
        for c in cases.values():
            # each row against the baselines over the same link (loopback, or the same two addresses)
            raw = next((b for b in cases.values() if b.system == "raw_zmq" and b.link == c.link), None)
            relay = next(
                (b for b in cases.values() if b.system == "raw_zmq_relay" and b.link == c.link), None
            )
            ray = next((b for b in cases.values() if b.system == "ray_queue" and b.link == c.link), None)
            table.add_row(
                size_name(size),
                c.name,
                str(c.shards or "-"),
                str(c.batch),
                f"{c.trajs_per_s:,.0f}",
                f"{c.mb_per_s:,.1f}",
                f"{c.mb_per_s / raw.mb_per_s:.0%}" if raw else "-",
                f"{c.mb_per_s / relay.mb_per_s:.0%}" if relay else "-",
                f"{c.mb_per_s / ray.mb_per_s:.1f}x" if ray else "-",
                f"{c.cpu_s_per_gb:.2f}" if c.cpu_s_per_gb is not None else "-",
            )
    console.print(table)
    if results.memory:
        console.print(memory_table(results.memory))
    console.print(f"machine: {results.machine}")


def memory_table(memory: list[MemoryPoint]) -> Table:
    """Shard memory at capacity, one row per point."""
    mem = Table(title="Shard memory at capacity")
    for col in (
        "size",
        "transport",
        "capacity",
        "payload MB",
        "RSS empty MB",
        "RSS full MB",
        "RSS growth / payload",
    ):
        mem.add_column(col, justify="right")
    for m in memory:
        mem.add_row(
            size_name(m.size),
            m.transport,
            str(m.capacity),
            f"{m.held_bytes / MB:.1f}",
            f"{m.rss_empty / MB:.1f}",
            f"{m.rss_full / MB:.1f}",
            f"{m.overhead:.2f}",
        )
    return mem


def to_json(results: Results) -> dict:
    return {
        "cases": [
            asdict(c)
            | {
                "name": c.name,
                "trajs_per_s": c.trajs_per_s,
                "mb_per_s": c.mb_per_s,
                "cpu_s_per_gb": c.cpu_s_per_gb,
            }
            for c in results.cases
        ],
        "memory": [asdict(m) | {"overhead": m.overhead} for m in results.memory],
        "machine": results.machine,
    }


DEFAULT_SIZES = "1KB,16KB,256KB,4MB"


def parse_args() -> argparse.Namespace:
    """The command line (checked: unknown transports are an error)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny volumes (seconds): smoke test")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help=f"comma-separated, of {list(SIZE_NAMES)}")
    ap.add_argument("--shards", default="1,4", help="comma-separated shard counts")
    ap.add_argument("--fsync", default="none", choices=["always", "interval", "none"])
    ap.add_argument("--transports", default="zmq,same-host", help=f"comma-separated, of {list(TRANSPORTS)}")
    ap.add_argument(
        "--mb-per-case",
        type=int,
        default=2048,
        help="payload volume per measurement (256KB: ~1-2 s timed on this class of machine)",
    )
    ap.add_argument(
        "--put-window", type=int, default=2, help="sluice: PUT messages in flight (1: wait for each)"
    )
    ap.add_argument(
        "--separate-ack", action="store_true", help="sluice: ACK each batch on its own, not with the next GET"
    )
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray queue baseline")
    ap.add_argument(
        "--extra-256kb",
        action="store_true",
        help="also 256KB, 1 shard, each transport: fsync=interval, no log, a consumer that reads",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="measure every case this many times, interleaved, and keep the median (a loaded machine)",
    )
    ap.add_argument(
        "--netns",
        action="store_true",
        help="also between two network namespaces (veth + bridge; root): raw ZeroMQ, relay, sluice zmq",
    )
    ap.add_argument("--out", default="benchmarks/results/buffer_throughput.json")
    args = ap.parse_args()
    if unknown := set(args.transports.split(",")) - set(TRANSPORTS):
        ap.error(f"--transports: unknown {sorted(unknown)}, choose from {list(TRANSPORTS)}")
    return args


def main() -> None:
    args = parse_args()
    console = Console()
    sizes = [SIZE_NAMES[s] for s in args.sizes.split(",")]
    shard_counts = [int(s) for s in args.shards.split(",")]
    transports = args.transports.split(",")
    opts = {"window": args.put_window, "ack_with_get": not args.separate_ack, "steady": not args.quick}
    budget = args.mb_per_case * MB
    lo, hi = 200, 20000
    ray_budget = min(budget, 128 * MB)
    memory_points = [(256 * KB, 1024, t) for t in transports] + [(KB, 65536, "zmq")]
    if args.quick:
        sizes = [KB, 256 * KB] if args.sizes == DEFAULT_SIZES else sizes
        budget, ray_budget, lo, hi = 16 * MB, 8 * MB, 50, 2000
        memory_points = [(256 * KB, 64, t) for t in transports]

    lab = open_lab(args.netns)
    results = Results(machine=machine_info(args, lab))
    ray = None if args.no_ray else RayBaseline()
    try:
        for size in sizes:
            n = count_for(size, budget, lo, hi)
            console.print(f"[bold]{size_name(size)}[/]: {n} trajectories per case")
            runs: list[Case] = []
            for _ in range(args.repeat):
                runs.append(bench_raw_zmq(size, n))
                runs.append(bench_raw_zmq(size, n, relay=True))
                if ray is not None:
                    runs.append(ray.run(size, count_for(size, ray_budget, lo // 2, hi // 4)))
                for shards in shard_counts:
                    for transport in transports:
                        runs.append(bench_sluice(shards, size, n, args.fsync, transport=transport, **opts))
                        progress(console, runs[-1])
                if args.extra_256kb and size == 256 * KB:
                    for transport in transports:
                        runs.append(bench_sluice(1, size, n, "interval", transport=transport, **opts))
                        runs.append(
                            bench_sluice(1, size, n, "none", durable=False, transport=transport, **opts)
                        )
                        runs.append(
                            bench_sluice(1, size, n, args.fsync, transport=transport, reads=True, **opts)
                        )
                if lab is not None:
                    runs += bench_across(lab, size, n, shard_counts, args.fsync, opts)
                    for c in runs[-len(shard_counts) :]:
                        progress(console, c)
            results.cases += medians(runs)
    finally:
        if ray is not None:
            ray.close()
        if lab is not None:
            lab.close()
    for size, capacity, transport in memory_points:
        results.memory.append(measure_memory(size, capacity, transport))
    results.machine["loadavg_end"] = os.getloadavg()
    report(results, console)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(to_json(results), indent=2))
    console.print(f"wrote {out}")


def machine_info(args: argparse.Namespace, lab: Lab | None) -> dict:
    """What the figures were measured on and with (the JSON's `machine`)."""
    info = {
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "python": platform.python_version(),
        "zmq": zmq.zmq_version(),
        "put_window": args.put_window,
        "ack_with_get": not args.separate_ack,
    }
    if lab is not None:
        info["netns"] = {h.label: h.addr for h in lab.hosts.values()}
        info["netns_tag"] = lab.tag  # the namespaces' names start with it
    return info


if __name__ == "__main__":
    main()
