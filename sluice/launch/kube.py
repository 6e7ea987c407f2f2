"""Kubernetes building blocks shared by the per-role layout (`sluice/launch/k8s.py`) and the
KubeRay RayJob (`sluice/launch/rayjob.py`): the ConfigMap that holds the resolved config, the
shared volume of run directories, pod volumes, resource requests from a role's `ray.<kind>`
resources, and the YAML writer. Why each piece is there: docs/deploy.md.
"""

from __future__ import annotations

import math
import re
from typing import Any

import yaml

from sluice.config.ray import RoleResources
from sluice.config.run import RunConfig

CONFIG_DIR, CONFIG_FILE = "/etc/sluice", "run.yaml"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_FILE}"
RUNS_CLAIM, RUNS_MOUNT = "sluice-runs", "/runs"
APP = {"app.kubernetes.io/name": "sluice"}
_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")


def check_name(name: str, what: str) -> str:
    """`name` if Kubernetes takes it as an object and host name (a DNS label), else a
    ValueError naming `what` it comes from (e.g. a policy id with an underscore)."""
    if not _DNS_LABEL.fullmatch(name):
        raise ValueError(
            f"{what}: {name!r} cannot be a Kubernetes name (lower-case letters, digits and '-', "
            "starting with a letter, at most 63)"
        )
    return name


def config_map(name: str, cfg: RunConfig) -> dict[str, Any]:
    """A ConfigMap whose key run.yaml is `cfg` resolved, as `sluice config` prints it: every pod
    mounts it at /etc/sluice and reads the same file."""
    text = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "labels": dict(APP)},
        "data": {CONFIG_FILE: text},
    }


def runs_claim(size: str = "20Gi") -> dict[str, Any]:
    """The volume every pod mounts at /runs: run directories (model, logs, metrics,
    checkpoints). ReadWriteMany, since the roles of one run sit on several nodes."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": RUNS_CLAIM, "labels": dict(APP)},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": size}}},
    }


Objects = list[dict[str, Any]]


def pod_volumes(config_name: str | None, shm: bool = True) -> tuple[Objects, Objects]:
    """(volumes, mounts) of a pod: the run volume; with `shm`, a memory-backed /dev/shm (a
    container's default is 64 MiB: too small for a shard's in-memory segments, torch or NCCL;
    KubeRay mounts its own in Ray pods); with `config_name`, the config read-only at
    /etc/sluice."""
    volumes: Objects = [{"name": "runs", "persistentVolumeClaim": {"claimName": RUNS_CLAIM}}]
    mounts: Objects = [{"name": "runs", "mountPath": RUNS_MOUNT}]
    if shm:
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    if config_name is not None:
        volumes.append({"name": "config", "configMap": {"name": config_name}})
        mounts.append({"name": "config", "mountPath": CONFIG_DIR, "readOnly": True})
    return volumes, mounts


def cpu_quantity(cpus: float) -> str:
    """A CPU count as a Kubernetes quantity: 1 -> "1", 0.5 -> "500m"."""
    return str(int(cpus)) if float(cpus).is_integer() else f"{round(cpus * 1000)}m"


def pod_resources(res: RoleResources) -> dict[str, Any]:
    """Requests (and GPU limits) of a role's container from its `ray.<kind>` resources: the
    CPUs, and NVIDIA GPUs rounded up (Kubernetes has no fraction of a GPU). Other Ray
    resources (NPU, custom labels) have no general Kubernetes name: add them by hand."""
    out: dict[str, Any] = {"requests": {"cpu": cpu_quantity(res.num_cpus)}}
    if res.num_gpus > 0:
        out["limits"] = {"nvidia.com/gpu": math.ceil(res.num_gpus)}
    return out


class _Dumper(yaml.SafeDumper):
    """Writes a multi-line string (the config in a ConfigMap) as a literal block."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def manifest_text(header: str, documents: list[dict[str, Any]]) -> str:
    """`header` (comment lines) and the documents as one multi-document YAML file."""
    body = yaml.dump_all(documents, Dumper=_Dumper, sort_keys=False, width=110, explicit_start=True)
    return header + "\n" + body
