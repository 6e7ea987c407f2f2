"""Addresses and ports of a container layout, where every role process has a host name of its own
(its role name) and fixed ports: what `sluice compose` and `sluice k8s` share.

The addresses are `SLUICE__*` variables (`service_addresses`): compose sets them on every
container, and the Kubernetes layout applies them to the config it stores (`with_env`). The
ports each role opens are read back from that config (`served_ports`, `metrics_port`), so the
files list what the roles bind. docs/deploy.md has the table of ports; docs/architecture.md,
"Role plan", the plan.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from sluice.config.loader import apply_override, config_from_dict, env_overrides
from sluice.config.policy import policy_view
from sluice.config.run import RunConfig
from sluice.launch.plan import RoleSpec

BUFFER_PORT, CONTROL_PORT, STORE_PORT, DIST_PORT, METRICS_PORT = 5555, 5600, 29500, 29400, 9100


def service_addresses(cfg: RunConfig, run_dir: str) -> dict[str, str]:
    """The `SLUICE__*` variables (and OMP_NUM_THREADS) that give every role the others'
    addresses, with role names as hosts: shard k at buffer-k, each learner group's rank 0 at
    learner[-<policy>] with a control, weight-sync store and rendezvous port of its own."""
    shards = range(cfg.buffer.shards)
    env = {
        "SLUICE__RUN__DIR": run_dir,
        "SLUICE__BUFFER__ENDPOINTS": json.dumps([f"tcp://buffer-{k}:{BUFFER_PORT + k}" for k in shards]),
        "SLUICE__BUFFER__BIND": json.dumps([f"tcp://*:{BUFFER_PORT + k}" for k in shards]),
        "SLUICE__CONTROL__HOST": "learner",
        "SLUICE__CONTROL__PORT": str(CONTROL_PORT),
        "SLUICE__CONTROL__BIND": f"tcp://*:{CONTROL_PORT}",
        "SLUICE__WEIGHT_SYNC__MASTER_ADDR": "learner",
        "SLUICE__WEIGHT_SYNC__MASTER_PORT": str(STORE_PORT),
        "SLUICE__LEARNER__MASTER_ADDR": "learner",
        "SLUICE__LEARNER__MASTER_PORT": str(DIST_PORT),
        "SLUICE__METRICS__PROMETHEUS_HOST": "0.0.0.0",
        "SLUICE__METRICS__BASE_PORT": str(METRICS_PORT),
        "OMP_NUM_THREADS": "1",
    }
    others = cfg.learner.policies[1:]
    if others:
        groups = {
            p: {"control": CONTROL_PORT + j, "weight_sync": STORE_PORT + j, "dist": DIST_PORT + j,
                "host": f"learner-{p}"}
            for j, p in enumerate(others, 1)
        }  # fmt: skip
        env["SLUICE__LEARNER__GROUP_PORTS"] = json.dumps(groups)
    return env


def with_env(cfg: RunConfig, env: Mapping[str, str]) -> RunConfig:
    """`cfg` as a role reads it with the `SLUICE__*` variables of `env` set (the others are
    ignored), by the loader's own rules."""
    tree = cfg.model_dump(mode="json")
    for keys, value, name in env_overrides(env):
        apply_override(tree, keys, value, label=name)
    return config_from_dict(tree)


def role_command(spec: RoleSpec, config_path: str) -> list[str]:
    """The per-role command line (after `sluice`) that runs `spec` with the config at
    `config_path`: `buffer CONFIG --shard K`, `rollout CONFIG --index I`, `learner CONFIG
    --policy P`."""
    args = spec.args
    return [args[0], config_path, *args[1:]]


def served_ports(cfg: RunConfig, spec: RoleSpec) -> dict[str, int]:
    """The ports `spec` listens on besides metrics, by name, as `cfg` says: a shard its
    endpoint; each learner group's rank 0 its control server, weight-sync store and group
    rendezvous (`learner.master_port`, used when learner.ranks > 1). The snapshot port
    (weight_sync.transfer.port) and the collectives' own connections are not fixed here."""
    if spec.kind == "buffer":
        return {"buffer": int(cfg.buffer.bind_endpoint(spec.index).rsplit(":", 1)[1])}
    if spec.kind == "learner" and spec.group_rank == 0:
        view = policy_view(cfg, spec.policy)
        return {
            "control": view.control.port,
            "weight-sync": view.weight_sync.master_port,
            "dist": view.learner.master_port,
        }
    return {}


def metrics_port(cfg: RunConfig, spec: RoleSpec) -> int:
    """The Prometheus port `spec` serves (0: a free one): metrics.base_port plus the role's
    offset; a learner rank's is 100 + 10 * its policy's index + its rank (learner/metrics.py)."""
    if spec.kind == "learner":
        return cfg.metrics.port("learner", cfg.learner.policies.index(spec.policy) * 10 + spec.index)
    return cfg.metrics.port(spec.kind, spec.index)
