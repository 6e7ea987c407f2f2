"""deploy/k8s/: the per-role Kubernetes layout and the KubeRay RayJob are what `sluice k8s`
writes for the quickstart, valid against Kubernetes' and KubeRay's schemas, and every command
in them is a valid CLI command line for a role of the plan of the config they mount."""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_deploy import parse_cli
from typer.testing import CliRunner

from sluice.cli import app
from sluice.config.loader import config_from_dict, load_config
from sluice.config.run import RunConfig
from sluice.launch.k8s import k8s_config, k8s_documents, k8s_text
from sluice.launch.layout import metrics_port
from sluice.launch.plan import find_spec, plan_roles
from sluice.launch.ray_launcher import plan_resources
from sluice.launch.rayjob import rayjob_documents, rayjob_text

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
CARTPOLE = ROOT / "configs" / "cartpole.yaml"
TWO_POLICIES = ["learner.policies=[a, b]", "learner.ranks=2", "buffer.shards=2", "buffer.durable=false"]
RAYJOB_SCHEMA = ROOT / "tests" / "data" / "kuberay" / "ray.io_rayjobs.v1.schema.json"
# The oldest Kubernetes the layout is written for (Job podFailurePolicy is GA from 1.31) and the
# newest whose schemas the installed kubernetes-validate ships.
K8S_VERSIONS = ("1.31", "latest")


def documents(path: Path) -> list[dict[str, Any]]:
    return list(yaml.safe_load_all(path.read_text()))


def by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for doc in docs:
        out.setdefault(doc["kind"], {})[doc["metadata"]["name"]] = doc
    return out


def mounted_config(pod_spec: dict[str, Any], path: str, configs: dict[str, dict]) -> RunConfig:
    """The config a container reads at `path`, through its ConfigMap volume."""
    (container,) = pod_spec["containers"]
    for mount in container["volumeMounts"]:
        if path.startswith(mount["mountPath"] + "/"):
            volume = next(v for v in pod_spec["volumes"] if v["name"] == mount["name"])
            data = configs[volume["configMap"]["name"]]["data"]
            return config_from_dict(yaml.safe_load(data[path[len(mount["mountPath"]) + 1 :]]))
    raise AssertionError(f"{path} is not on a mounted volume")


def test_the_k8s_layout_is_the_role_plans_and_current():
    """deploy/k8s/quickstart.yaml is `sluice k8s configs/quickstart.yaml`, regenerated here."""
    cfg = load_config(QUICKSTART)
    assert (K8S / "quickstart.yaml").read_text() == k8s_text(cfg, "configs/quickstart.yaml")


def test_the_rayjob_is_current():
    """deploy/k8s/rayjob.yaml is `sluice k8s configs/quickstart.yaml --ray`, regenerated here."""
    cfg = load_config(QUICKSTART)
    assert (K8S / "rayjob.yaml").read_text() == rayjob_text(cfg, "configs/quickstart.yaml")


def _kubernetes_objects() -> list[dict[str, Any]]:
    two = k8s_documents(load_config(CARTPOLE, TWO_POLICIES))
    return documents(K8S / "quickstart.yaml") + two + documents(K8S / "rayjob.yaml")[:2]


def test_manifests_match_the_kubernetes_schemas():
    """Every built-in object (both files, and a layout with two policies, learner groups of two
    and shards without logs) against the official schemas, strict: an unknown field fails."""
    kv = pytest.importorskip("kubernetes_validate")
    versions = [kv.latest_version() if v == "latest" else v for v in K8S_VERSIONS]
    for doc in _kubernetes_objects():
        for version in versions:
            kv.validate(doc, version, strict=True)


def test_the_schema_check_sees_a_mistake():
    kv = pytest.importorskip("kubernetes_validate")
    job = copy.deepcopy(by_kind(documents(K8S / "quickstart.yaml"))["Job"]["learner"])
    job["spec"]["template"]["spec"]["containers"][0]["imagePulPolicy"] = "Always"
    with pytest.raises(kv.ValidationError, match="imagePulPolicy"):
        kv.validate(job, kv.latest_version(), strict=True)


def _strict(schema: Any) -> Any:
    """A CRD schema as the API server applies it with strict field validation (kubectl's
    default): an object schema that lists its properties takes no others."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    open_ended = "additionalProperties" in out or out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and not open_ended:
        out["additionalProperties"] = False
    return out


def test_the_rayjob_matches_kuberays_crd():
    """The RayJob against KubeRay's CRD schema (tests/data/kuberay/README.md), and its pod
    templates against Kubernetes' PodTemplate schema; a misspelt field fails."""
    jsonschema = pytest.importorskip("jsonschema")
    kv = pytest.importorskip("kubernetes_validate")
    validator = jsonschema.Draft7Validator(_strict(json.loads(RAYJOB_SCHEMA.read_text())))
    rayjob = by_kind(documents(K8S / "rayjob.yaml"))["RayJob"]["sluice"]
    gpus = load_config(CARTPOLE, [*TWO_POLICIES, "ray.learner.num_gpus=1", "ray.rollout.num_cpus=0.5"])
    for job in (rayjob, by_kind(rayjob_documents(gpus))["RayJob"]["sluice"]):
        validator.validate(job)
        cluster = job["spec"]["rayClusterSpec"]
        for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
            template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}}
            kv.validate({**template, "template": group["template"]}, kv.latest_version(), strict=True)
    bad = copy.deepcopy(rayjob)
    bad["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replica"] = 1
    assert not validator.is_valid(bad)


def _check_roles(docs: list[dict[str, Any]], cfg: RunConfig) -> None:
    """One Service and one workload per role of the plan, each running the per-role command
    that stands for its spec, on the config of the ConfigMap it mounts."""
    kinds = by_kind(docs)
    workloads = kinds["StatefulSet"] | kinds["Job"]
    resolved = k8s_config(cfg)
    specs = plan_roles(resolved)
    assert set(workloads) == set(kinds["Service"]) == {s.name for s in specs}
    for spec in specs:
        assert (spec.name in kinds["StatefulSet"]) == (spec.kind == "buffer")
        pod = workloads[spec.name]["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        command, params = parse_cli(container["args"])
        seen = mounted_config(pod, params["config"], kinds["ConfigMap"])
        assert seen == resolved and command == spec.kind
        env = {e["name"]: e["value"] for e in container["env"]}
        rank = int(env.get("RANK", "0"))
        index = {"buffer": params.get("shard"), "rollout": params.get("index"), "learner": rank}[spec.kind]
        assert find_spec(seen, command, index, params.get("policy")) == spec
        assert env.items() >= spec.env.items()
        service = kinds["Service"][spec.name]["spec"]
        assert service["clusterIP"] == "None"
        assert service["selector"].items() <= pod_labels(workloads[spec.name])
        ports = {p["name"]: p["port"] for p in service["ports"]}
        assert ports == {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == metrics_port(seen, spec)


def pod_labels(workload: dict[str, Any]) -> Any:
    return workload["spec"]["template"]["metadata"]["labels"].items()


def test_k8s_roles_run_the_cli_on_the_mounted_config():
    docs = documents(K8S / "quickstart.yaml")
    cfg = load_config(QUICKSTART)
    _check_roles(docs, cfg)
    kinds = by_kind(docs)
    seen = config_from_dict(yaml.safe_load(kinds["ConfigMap"]["sluice-config"]["data"]["run.yaml"]))
    services = kinds["Service"]
    for k, endpoint in enumerate(seen.buffer.all_endpoints()):  # every address is a Service's port
        host, port = re.fullmatch(r"tcp://([\w-]+):(\d+)", endpoint).groups()
        assert host == f"buffer-{k}" and int(port) in [p["port"] for p in services[host]["spec"]["ports"]]
    learner = {p["name"]: p["port"] for p in services[seen.control.host]["spec"]["ports"]}
    assert seen.control.host == seen.weight_sync.master_addr == seen.learner.master_addr == "learner"
    assert learner["control"] == seen.control.port and learner["weight-sync"] == seen.weight_sync.master_port
    assert seen.run.dir == "/runs/k8s" and seen.buffer.log_dir == "/var/lib/sluice/buffer"
    shard = kinds["StatefulSet"]["buffer-0"]["spec"]
    assert shard["volumeClaimTemplates"][0]["metadata"]["name"] == "buffer-log"
    mounts = shard["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "buffer-log", "mountPath": seen.buffer.log_dir} in mounts
    assert {"name": "runs", "mountPath": "/runs"} in mounts


def test_k8s_for_two_policies_and_a_learner_group_of_two():
    cfg = load_config(CARTPOLE, TWO_POLICIES)
    docs = k8s_documents(cfg)
    _check_roles(docs, cfg)
    kinds = by_kind(docs)
    assert {"learner", "learner-r1", "learner-b", "learner-b-r1"} <= set(kinds["Job"])
    rank1 = kinds["Job"]["learner-b-r1"]["spec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in rank1["containers"][0]["env"]}
    dist = {p["name"]: p["port"] for p in kinds["Service"]["learner-b"]["spec"]["ports"]}["dist"]
    assert env["MASTER_ADDR"] == "learner-b" and env["MASTER_PORT"] == str(dist) and env["RANK"] == "1"
    assert rank1["hostname"] == "learner-b-r1"
    assert "volumeClaimTemplates" not in kinds["StatefulSet"]["buffer-1"]["spec"]  # no log to keep


def test_metrics_ports_are_the_ones_the_roles_serve():
    from sluice.learner.metrics import _port

    cfg = k8s_config(load_config(CARTPOLE, TWO_POLICIES))
    for spec in plan_roles(cfg):
        if spec.kind == "learner":
            assert metrics_port(cfg, spec) == _port(cfg, spec.policy, spec.index)


def test_jobs_stop_on_the_exits_a_restart_repeats():
    """A rollout may restart as often as the plan says; exit 2 or 3 fails its Job at once."""
    from sluice.launch.role import EXIT_CONFIG, EXIT_USER_CODE

    cfg = load_config(QUICKSTART)
    job = by_kind(documents(K8S / "quickstart.yaml"))["Job"]["rollout-1"]["spec"]
    assert job["backoffLimit"] == cfg.rollout.max_restarts
    (fail,) = [r for r in job["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
    assert fail["onExitCodes"]["values"] == [EXIT_CONFIG, EXIT_USER_CODE]
    assert job["template"]["spec"]["restartPolicy"] == "Never"


def test_the_rayjob_runs_sluice_ray_on_a_cluster_that_holds_the_plan():
    docs = documents(K8S / "rayjob.yaml")
    kinds = by_kind(docs)
    spec = kinds["RayJob"]["sluice"]["spec"]
    command, params = parse_cli(shlex.split(spec["entrypoint"])[1:])
    assert command == "ray" and params["no_progress"]
    cluster = spec["rayClusterSpec"]
    head = cluster["headGroupSpec"]
    cfg = mounted_config(head["template"]["spec"], params["config"], kinds["ConfigMap"])
    assert cfg.ray.address == "auto" and cfg.run.dir.startswith("/runs/")
    assert cfg.buffer.log_dir == cfg.run.dir + "/buffer"  # a restarted shard finds its log anywhere
    assert head["rayStartParams"]["num-cpus"] == "0"  # the head runs the driver only
    need = plan_resources(plan_roles(cfg))
    groups = cluster["workerGroupSpecs"]
    have = sum(g["replicas"] * float(g["rayStartParams"]["num-cpus"]) for g in groups)
    assert have == need["CPU"] and all(g["minReplicas"] == g["replicas"] == g["maxReplicas"] for g in groups)
    for group in [head, *groups]:
        (container,) = group["template"]["spec"]["containers"]
        assert {"name": "runs", "mountPath": "/runs"} in container["volumeMounts"]
    major, minor = map(int, cluster["rayVersion"].split(".")[:2])
    assert (major, minor) >= (2, 53)  # KubeRay then probes over HTTP: the image has no wget


def test_the_header_commands_parse_with_the_cli():
    """The `sluice ...` commands the generated files' headers show are valid command lines."""
    for path in (K8S / "quickstart.yaml", K8S / "rayjob.yaml"):
        lines = [line for line in path.read_text().splitlines() if line.startswith("#")]
        made_by = re.search(r"`sluice (.*?)`", lines[0]).group(1)
        command, params = parse_cli(shlex.split(made_by))
        assert command == "k8s" and params["ray"] == path.name.startswith("rayjob")
        for line in lines:
            if "-- sluice " in line:
                parse_cli(shlex.split(line.split("-- sluice ", 1)[1].split("#")[0]))


def test_the_cli_writes_the_files_and_refuses_a_policy_kubernetes_cannot_name(tmp_path):
    runner = CliRunner()
    out = tmp_path / "k8s.yaml"
    done = runner.invoke(app, ["k8s", str(QUICKSTART), "--out", str(out)])
    assert done.exit_code == 0 and out.read_text() == (K8S / "quickstart.yaml").read_text()
    ray = runner.invoke(app, ["k8s", str(QUICKSTART), "--ray", "--image", "registry.example/sluice:1"])
    cluster = by_kind(list(yaml.safe_load_all(ray.output)))["RayJob"]["sluice"]["spec"]["rayClusterSpec"]
    pods = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    assert {g["template"]["spec"]["containers"][0]["image"] for g in pods} == {"registry.example/sluice:1"}
    bad = runner.invoke(app, ["k8s", str(CARTPOLE), "learner.policies=[a, Big_one]"])
    assert bad.exit_code == 2 and "'learner-Big_one' cannot be a Kubernetes name" in bad.output
