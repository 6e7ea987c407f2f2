"""Packs of sim rollout services (`sluice rollout --index I --count N`, rollout_svc/pack.py):
each packed service is a whole member of the run (its own id, heartbeats, admission, PUTs)
while the process imports no torch; a killed pack takes exactly its own services off the
control plane, and their quota comes back."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from helpers.bench_scripts import run_script
from helpers.procs import start
from helpers.sim_services import DrainThread, sim_config
from helpers.wait import running, wait_until
from prometheus_client import CollectorRegistry, Counter, generate_latest

from sluice.config.loader import ConfigError
from sluice.control.client import ControlClient
from sluice.rollout_svc.pack import PackMetrics, check_packable

PACK_SECTIONS = {
    "buffer": {"shards": 2},
    "learner": {"batch_size": 16, "max_staleness": 1000},  # admission on, never binding
}


def start_pack(path: Path, first: int, count: int, reaper: list, log: Path) -> subprocess.Popen:
    """`sluice rollout --index first --count count`, its imports listed in `log` (-X importtime)."""
    args = [
        "-X",
        "importtime",
        "-m",
        "sluice.cli",
        "rollout",
        str(path),
        "--index",
        str(first),
        "--count",
        str(count),
    ]
    return start(args, reaper, stdout=subprocess.DEVNULL, stderr=log.open("wb"))


def pack_setup(tmp_path: Path, shard_factory, **control):
    shards = [shard_factory(), shard_factory()]
    cfg, path = sim_config(
        tmp_path,
        shards[0],
        buffer={"shards": 2, "endpoints": [s.endpoint for s in shards]},
        control={"heartbeat_s": 0.5, **control},
        learner=PACK_SECTIONS["learner"],
    )
    return cfg, path


def stop_packs(packs: list[subprocess.Popen], drain: DrainThread) -> list[int]:
    """SIGTERM every live pack (services first, while the control plane answers); exit codes."""
    for p in packs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    codes = [p.wait(timeout=60) for p in packs]
    drain.close()
    return codes


def imported(log: Path) -> set[str]:
    """Modules a process imported, from its `-X importtime` lines."""
    return {
        line.rsplit("|", 1)[1].strip()
        for line in log.read_text().splitlines()
        if line.startswith("import time:")
    }


@pytest.mark.slow
def test_packed_services_are_each_a_member_and_deliver_without_torch(tmp_path, shard_factory, process_reaper):
    cfg, path = pack_setup(tmp_path, shard_factory)
    drain = DrainThread(cfg)
    control = ControlClient(cfg.control.endpoint, timeout_s=10)
    logs = [tmp_path / "pack-0.log", tmp_path / "pack-25.log"]
    packs = [
        start_pack(path, 0, 25, process_reaper, logs[0]),
        start_pack(path, 25, 25, process_reaper, logs[1]),
    ]
    try:
        drain.wait_for(lambda s: len(s.per_service) == 50, timeout_s=90, procs=packs)
        status = control.status()
        members = {sid.split(".")[0] for sid in status.services}
        assert members == {f"rollout-{i}" for i in range(50)}  # each heartbeats under its own id
        assert all(
            s.role == "rollout" and s.age_s < cfg.control.service_timeout_s for s in status.services.values()
        )
        delivered = drain.drain.snapshot().per_service
        assert {sid.split(".")[0] for sid in delivered} == members and min(delivered.values()) > 0
        assert status.admission["services_gone"] == 0
    finally:
        control.close()
        codes = stop_packs(packs, drain)
    assert codes == [0, 0]
    for log in logs:
        mods = imported(log)
        assert "sluice.rollout_svc.pack" in mods
        assert not {m for m in mods if m.split(".")[0] in ("torch", "transformers")}


@pytest.mark.slow
def test_a_killed_pack_takes_exactly_its_services_off_and_gives_their_quota_back(
    tmp_path, shard_factory, process_reaper
):
    cfg, path = pack_setup(tmp_path, shard_factory, service_timeout_s=2.0)
    drain = DrainThread(cfg)
    control = ControlClient(cfg.control.endpoint, timeout_s=10)
    a = start_pack(path, 0, 10, process_reaper, tmp_path / "a.log")
    b = start_pack(path, 10, 10, process_reaper, tmp_path / "b.log")
    try:
        drain.wait_for(lambda s: len(s.per_service) == 20, timeout_s=90, procs=[a, b])
        os.killpg(a.pid, signal.SIGKILL)  # the whole pack, without a word
        a.wait(timeout=10)
        wait_until(lambda: control.status().admission["services_gone"] >= 10, 30, "pack a's services gone",
                   check=running({"pack b": b}), interval_s=0.2)  # fmt: skip
        gone = {sid for sid in drain.drain.snapshot().per_service if int(sid.split(".")[0][8:]) < 10}
        before = drain.drain.snapshot().per_service
        # the other pack keeps delivering, every one of its services
        drain.wait_for(lambda s: all(s.per_service[k] > before[k] for k in before if k not in gone), 60, [b])
        status = control.status()
        assert status.admission["services_gone"] == 10  # exactly pack a's
        assert {sid.split(".")[0] for sid in status.services} == {f"rollout-{i}" for i in range(10, 20)}
        admission = drain.drain.control.admission
        with drain.drain.control._lock:  # (the server thread admits meanwhile)
            held_by_live = sum(admission.per_service.values())
            started = admission.started
            assert not gone & set(admission.per_service)
        # what is started is what live services hold plus what the dead ones delivered: the
        # quota pack a held and did not deliver came back, and no more than that
        seen = drain.drain.snapshot().per_service
        assert started - held_by_live == sum(seen[g] for g in gone)
    finally:
        control.close()
        stop_packs([a, b], drain)


def test_only_sim_services_are_packed(tmp_path):
    from sluice.config.loader import config_from_dict

    cfg = config_from_dict({"run": {"dir": str(tmp_path)}, "rollout": {"engine": "hf"}})
    check_packable(cfg, 1)  # one service is not a pack: any engine
    with pytest.raises(ConfigError, match="sim services only"):
        check_packable(cfg, 8)
    with pytest.raises(ConfigError, match="--count 0"):
        check_packable(cfg, 0)


def test_the_role_plan_packs_sim_services_when_asked(tmp_path):
    from sluice.config.loader import config_from_dict
    from sluice.launch.plan import find_spec, plan_roles

    tree = {"run": {"dir": str(tmp_path)}, "rollout": {"engine": "sim", "services": 10}}
    cfg = config_from_dict({**tree, "rollout": {**tree["rollout"], "sim": {"services_per_process": 4}}})
    packs = [s for s in plan_roles(cfg) if s.kind == "rollout"]
    assert [(s.name, s.index, s.count) for s in packs] == [
        ("rollout-0-3", 0, 4), ("rollout-4-7", 4, 4), ("rollout-8-9", 8, 2)
    ]  # fmt: skip
    assert packs[1].args == ["rollout", "--index", "4", "--count", "4"]
    assert find_spec(cfg, "rollout", 4) == packs[1]  # `sluice rollout --index 4`: the pack
    assert [s.count for s in plan_roles(config_from_dict(tree)) if s.kind == "rollout"] == [1] * 10
    with pytest.raises(ConfigError, match="services_per_process > 1 packs sim LLM services only"):
        config_from_dict({"run": {"dir": str(tmp_path)}, "rollout": {"sim": {"services_per_process": 2}}})


def test_one_metrics_endpoint_serves_every_packed_service_by_name(tmp_path):
    from sluice.config.loader import config_from_dict

    metrics = PackMetrics(config_from_dict({"run": {"dir": str(tmp_path)}}), first=0)
    for name, n in (("rollout-0", 3), ("rollout-1", 5)):
        registry: CollectorRegistry = metrics.for_service(name).registry
        Counter("sluice_rollout_samples", "Trajectories produced", registry=registry).inc(n)
    text = generate_latest(metrics.endpoint.registry).decode()
    assert 'sluice_rollout_samples_total{service="rollout-0"} 3.0' in text
    assert 'sluice_rollout_samples_total{service="rollout-1"} 5.0' in text


@pytest.mark.slow
def test_scale_clients_benchmark_quick(tmp_path):
    import json

    run_script(["benchmarks/scale_clients.py", "--quick", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "scale_clients.json").read_text())
    assert (tmp_path / "scale_clients.png").stat().st_size > 0
    rows = result["rows"]
    assert [r["services"] for r in rows] == [4, 8]
    for r in rows:
        assert r["members"] == r["services"] and r["services_gone"] == 0 and r["heartbeats_missed"] == 0
        assert r["samples_per_s"] > 0 and r["batches"] > 0
        assert set(r["cpu_cores"]) == {"shards", "busiest_shard", "learner", "packs", "other_load"}
