"""End to end: a real `sluice run` with CURVE security on, observed from outside while it runs:
Prometheus endpoints of every role, `sluice status`, and the plots written when it ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from helpers.runs import ROOT, start_run, wait_for_steps
from helpers.wait import wait_until
from prometheus_client.parser import text_string_to_metric_families

from sluice.security import generate_keys

pytestmark = pytest.mark.slow

# role -> metrics that role's endpoint must serve (a counter's sample carries the _total suffix)
NAMED_METRICS = {
    "learner": ["sluice_learner_version", "sluice_learner_reward_mean", "sluice_learner_staleness_mean"],
    "buffer-0": ["sluice_buffer_queued", "sluice_buffer_capacity", "sluice_buffer_put"],
    "rollout-0": ["sluice_rollout_version", "sluice_rollout_samples_total", "sluice_rollout_reward_mean"],
    "rollout-1": ["sluice_rollout_version", "sluice_rollout_samples_total", "sluice_rollout_reward_mean"],
}


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def status_json(run_dir: Path, *overrides: str, expect: int = 0) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "status", str(run_dir), *overrides, "--json", "--timeout", "5"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == expect, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_secure_run_serves_metrics_and_status_and_writes_plots(tmp_path, process_reaper):
    keys = generate_keys(tmp_path / "keys")
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "SLUICE__SECURITY__CURVE": "true",
        "SLUICE__SECURITY__KEYS_DIR": str(keys.directory),
    }
    proc = start_run(run_dir, "learner.total_steps=100000", env=env)
    process_reaper.append(proc)
    wait_for_steps(run_dir, 5, proc)
    resolved = (run_dir / "config.yaml").read_text()
    assert "curve: true" in resolved  # the environment reached the resolved config

    # every role's Prometheus endpoint answers with its named metrics, with live values. A service
    # records its endpoint once its engine is built: a slow starter may not have by step 5
    endpoints_dir = run_dir / "endpoints"
    wait_until(
        lambda: {p.stem for p in endpoints_dir.glob("*.json")} >= set(NAMED_METRICS),
        120,
        lambda: f"every role's endpoint file (have {sorted(p.stem for p in endpoints_dir.glob('*.json'))})",
        interval_s=0.5,
        check=lambda: None if proc.poll() is None else pytest.fail(f"run exited {proc.returncode}"),
    )
    endpoints = {p.stem: json.loads(p.read_text()) for p in endpoints_dir.glob("*.json")}
    assert set(endpoints) == set(NAMED_METRICS)
    for role, names in NAMED_METRICS.items():
        if role.startswith("rollout-"):
            continue  # below: a slow starter may not have loaded weights by step 5
        samples = scrape(endpoints[role]["metrics_port"])
        missing = [n for n in names if n not in samples]
        assert not missing, (role, missing)
    assert scrape(endpoints["learner"]["metrics_port"])["sluice_learner_version"] >= 5
    # each rollout's metrics go live: its version gauge has a sample once it loaded weights, its
    # counter once it generated (a slow starter may not have by step 5: the other service can
    # fill the first steps alone)
    for i in (0, 1):
        port, names = endpoints[f"rollout-{i}"]["metrics_port"], NAMED_METRICS[f"rollout-{i}"]
        wait_until(
            lambda port=port, names=names: (
                (s := scrape(port)).get("sluice_rollout_samples_total", 0) > 0 and all(n in s for n in names)
            ),
            120,
            f"rollout-{i} serving its named metrics and counting samples",
            interval_s=0.5,
            check=lambda: None if proc.poll() is None else pytest.fail(f"run exited {proc.returncode}"),
        )

    # `sluice status` (a CURVE client with the run's keys) shows live numbers; a rollout reports
    # its rate in the first heartbeat after it has generated (a slow starter may not have yet)
    def with_rates() -> tuple[dict, dict] | None:
        status = status_json(run_dir)
        rows = {r["role"]: r for r in status["rows"]}
        rates = [rows.get(f"rollout-{i}", {}).get("samples_per_s") for i in (0, 1)]
        return (status, rows) if all(rate is not None for rate in rates) else None

    first, rows = wait_until(with_rates, 60, "both rollouts' rates in `sluice status`", interval_s=1.0)
    assert all(r["state"] == "ok" for r in rows.values()), rows
    assert rows["learner"]["version"] >= 5 and rows["learner"]["samples_per_s"] > 0
    assert rows["buffer-0"]["fill"] is not None
    for i in (0, 1):
        r = rows[f"rollout-{i}"]
        assert r["version"] >= 0 and r["heartbeat_age_s"] < 30 and r["samples_per_s"] > 0
        assert r["pid"] == endpoints[f"rollout-{i}"]["pid"]
    assert first["admission"]["started"] > 0
    wait_for_steps(run_dir, int(rows["learner"]["version"]) + 3, proc)
    second = {r["role"]: r for r in status_json(run_dir)["rows"]}
    assert second["learner"]["version"] > rows["learner"]["version"]  # live, not a stale copy

    # the run's sockets really are CURVE: a plain client gets no answer from any role
    plain = status_json(run_dir, "security.curve=false", expect=1)
    assert {r["state"] for r in plain["rows"]} == {"unreachable"}

    table = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "status", str(run_dir), "--once"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert table.returncode == 0 and "rollout-1" in table.stdout and "admission: started" in table.stdout

    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=90) == 130
    for name in ("reward.png", "staleness.png", "throughput.png"):
        assert (run_dir / "plots" / name).stat().st_size > 10_000
