"""deploy/: the compose file, Ray cluster YAML, systemd units and Slurm scripts match the CLI
and the config they run."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
import typer
import yaml

from sluice.cli import app
from sluice.config.loader import load_config

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
ROLE_COMMANDS = {"buffer", "learner", "rollout", "status"}


def parse_cli(args: list[str]) -> tuple[str, dict]:
    """Parse a command line with the real CLI (no command runs): (command, its parameters)."""
    group = typer.main.get_command(app)
    name, *rest = args
    command = group.get_command(click.Context(group), name)
    assert command is not None, f"no such command: {name}"
    ctx = command.make_context(f"sluice {name}", list(rest))
    return name, ctx.params


def compose_services() -> dict[str, dict]:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def host_path(service: dict, container_path: str) -> Path:
    """The file a container path maps to through the service's bind mounts."""
    for volume in service["volumes"]:
        source, target, *_ = volume.split(":")
        if container_path.startswith(target + "/") and source.startswith("."):
            return (COMPOSE.parent / source / container_path[len(target) + 1 :]).resolve()
    raise AssertionError(f"{container_path} is not under a bind mount of {service['volumes']}")


def test_compose_services_run_the_cli_with_a_mounted_config():
    services = compose_services()
    for name, svc in services.items():
        command, params = parse_cli(svc["command"])
        assert command in ROLE_COMMANDS, name
        config = params.get("config") or params.get("target")
        assert host_path(svc, config).is_file(), f"{name}: {config}"
        if command in ("buffer", "rollout"):
            index = params["shard" if command == "buffer" else "index"]
            assert name == f"{command}-{index}"


def test_compose_matches_the_config_it_runs():
    """The file plus the compose environment is a valid config whose addresses are compose
    services, with one service per shard and per rollout service."""
    services = compose_services()
    learner = services["learner"]
    cfg = load_config(host_path(learner, learner["command"][1]), env=learner["environment"])
    assert sorted(n for n in services if n.startswith("buffer-")) == [
        f"buffer-{k}" for k in range(cfg.buffer.shards)
    ]
    assert sorted(n for n in services if n.startswith("rollout-")) == [
        f"rollout-{i}" for i in range(cfg.rollout.services)
    ]
    for k, endpoint in enumerate(cfg.buffer.all_endpoints()):
        host, port = re.fullmatch(r"tcp://([\w-]+):(\d+)", endpoint).groups()
        assert host == f"buffer-{k}" and port in services[host]["expose"]
        assert cfg.buffer.bind_endpoint(k) == f"tcp://*:{port}"
    assert cfg.control.host == "learner" and str(cfg.control.port) in learner["expose"]
    assert cfg.weight_sync.master_addr == "learner" and str(cfg.weight_sync.master_port) in learner["expose"]
    assert cfg.metrics.prometheus_host == "0.0.0.0"
    published = {
        name: [int(p.split(":")[-1]) for p in svc.get("ports", [])] for name, svc in services.items()
    }
    assert cfg.metrics.port("learner") in published["learner"]
    for k in range(cfg.buffer.shards):
        assert cfg.metrics.port("buffer", k) in published[f"buffer-{k}"]
    for i in range(cfg.rollout.services):
        assert cfg.metrics.port("rollout", i) in published[f"rollout-{i}"]
    # every service shares the run directory and the environment
    for svc in services.values():
        assert svc["environment"] == learner["environment"] and "runs:/runs" in svc["volumes"]
    assert cfg.run.dir.startswith("/runs/")


def test_dockerfile_installs_what_compose_runs():
    text = (DEPLOY / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["sluice"]' in text
    for package in ("sluice", "buffer", "rollout_svc", "learner", "weight_sync"):
        assert f"COPY {package} ./{package}" in text
    assert (ROOT / ".dockerignore").is_file()


def _compose_client() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


@pytest.mark.skipif(_compose_client() is None, reason="no docker compose client on this machine")
def test_docker_compose_config_validates():
    proc = subprocess.run(
        [*_compose_client(), "-f", str(COMPOSE), "config", "--quiet"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr


def test_ray_cluster_yaml_matches_rays_schema():
    jsonschema = pytest.importorskip("jsonschema")
    ray_autoscaler = pytest.importorskip("ray.autoscaler")
    schema = json.loads((Path(ray_autoscaler.__file__).parent / "ray-schema.json").read_text())
    cluster = yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())
    jsonschema.validate(cluster, schema)
    assert cluster["provider"]["type"] == "local"
    commands = " ".join(cluster["setup_commands"] + cluster["head_start_ray_commands"])
    assert "scripts/setup.sh" in commands and (ROOT / "scripts" / "setup.sh").is_file()
    # the run command documented at the top is a valid `sluice ray` command line
    text = (DEPLOY / "ray" / "cluster.yaml").read_text()
    line = re.search(r"sluice ray (.*?)'", text.replace("\\\n#", "")).group(1)
    name, params = parse_cli(["ray", *shlex.split(line)])
    cfg = load_config(ROOT / params["config"], params["overrides"])
    assert cfg.ray.address == "auto" and cfg.ray.strategy == "SPREAD"


@pytest.mark.parametrize("unit", sorted((DEPLOY / "systemd").glob("*.service")), ids=lambda p: p.name)
def test_systemd_units_run_a_role(unit):
    text = unit.read_text()
    exec_start = re.search(r"^ExecStart=(.*)$", text, re.M).group(1)
    program, *args = shlex.split(exec_start.replace("%i", "0"))
    assert program.endswith("/sluice")
    command, _ = parse_cli(args)
    assert unit.name.startswith(f"sluice-{command}")
    assert "RestartPreventExitStatus=2" in text and "KillSignal=SIGTERM" in text


def test_slurm_script_is_valid_bash_running_each_role():
    script = DEPLOY / "slurm" / "sluice.sbatch"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    roles = re.findall(r'"\$SLUICE" (\w+) "\$CONFIG"', text)
    assert sorted(roles) == ["buffer", "config", "learner", "rollout"]
    assert "SLURM_PROCID" in text  # rollouts take --index from srun's task rank


def test_readme_run_commands_parse_with_the_cli():
    """The commands of the README's three ways to run are valid command lines."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    text = "\n".join(blocks).replace("\\\n", " ")
    lines = [line.split("#")[0].strip() for line in text.splitlines()]
    sluice_lines = [line.split(".venv/bin/sluice ", 1)[1] for line in lines if ".venv/bin/sluice " in line]
    assert {line.split()[0] for line in sluice_lines} >= {"run", "ray", "status"}
    for line in sluice_lines:
        args = shlex.split(line.rstrip("'"))
        command, params = parse_cli(args)
        if command in ("run", "ray"):
            load_config(ROOT / params["config"], params["overrides"])
    compose_lines = [line for line in lines if line.startswith("docker compose")]
    assert compose_lines and all("-f deploy/docker-compose.yml" in line for line in compose_lines)
    assert "status" in compose_services()


def test_readme_test_command_is_what_ci_runs():
    """The README's second command (set up and pass the tests) is the last line of .ci/run."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    ci_command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert blocks[1].strip() == ci_command
    assert '-m "not slow"' in ci_command and ci_command.index("not slow") < ci_command.index("-m slow")


def test_the_compose_file_is_the_role_plans_and_current():
    """deploy/docker-compose.yml is `sluice compose configs/quickstart.yaml`: regenerated here,
    it must come out the same (the layout cannot drift from `sluice run`'s)."""
    from sluice.launch.compose import compose_text

    cfg = load_config(ROOT / "configs" / "quickstart.yaml")
    assert COMPOSE.read_text() == compose_text(cfg, "/app/configs/quickstart.yaml", "configs/quickstart.yaml")


def test_compose_for_two_policies_and_a_learner_group_of_two():
    """Every planned process is a service; each reads a config whose addresses are services."""
    from sluice.config.policy import policy_view
    from sluice.launch.compose import compose_file
    from sluice.launch.plan import plan_roles

    overrides = ["learner.policies=[a, b]", "learner.ranks=2"]
    cfg = load_config(ROOT / "configs" / "cartpole.yaml", overrides)
    services = compose_file(cfg, "/app/configs/cartpole.yaml")["services"]
    assert set(services) - {"status"} == {s.name for s in plan_roles(cfg)}
    assert {"learner", "learner-r1", "learner-b", "learner-b-r1"} <= set(services)
    for name in ("learner", "learner-b-r1", "rollout-1"):
        svc = services[name]
        command, params = parse_cli(svc["command"])
        seen = load_config(ROOT / "configs" / "cartpole.yaml", overrides, env=svc["environment"])
        policy = params.get("policy") or ("b" if name == "rollout-1" else "a")
        view = policy_view(seen, policy)
        head = "learner" if policy == "a" else "learner-b"
        assert view.control.host == view.weight_sync.master_addr == head
        assert str(view.control.port) in services[head]["expose"]
    assert services["learner-b-r1"]["environment"]["MASTER_ADDR"] == "learner-b"
    assert services["learner-b-r1"]["environment"]["RANK"] == "1"


SLURM_RAY = DEPLOY / "slurm" / "sluice-ray.sbatch"


def _stub(bin_dir: Path, name: str, body: str) -> Path:
    path = bin_dir / name
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(0o755)
    return path


def _slurm_ray_stubs(tmp_path: Path) -> dict[str, str]:
    """Stand-ins for Slurm, Ray, Python and sluice that log their command lines: srun runs its
    command here, a blocking `ray start` runs until SIGTERM, and the wait for the cluster (the
    script's Python part) returns once both `ray start` steps run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    record = f'echo "$(basename "$0") $*" >> {log}'
    _stub(bin_dir, "scontrol", 'printf "node1\\nnode2\\nnode3\\n"')
    _stub(bin_dir, "hostname", 'echo "10.0.0.1 172.17.0.1"')
    _stub(bin_dir, "srun", f'{record}\nwhile [[ "$1" == -* ]]; do shift; done\nexec "$@"')
    stopped = f'echo "ray stopped" >> {log}; exit 0'
    block = f"trap '{stopped}' TERM; while :; do sleep 0.05; done"
    _stub(bin_dir, "ray", f'{record}\nif [[ " $* " == *" --block "* ]]; then {block}; fi')
    joined = f'[[ $(grep -c "^ray start" {log}) == 2 ]]'  # both Ray steps are up
    _stub(bin_dir, "python", f"{record}\ncat > /dev/null\nuntil {joined}; do sleep 0.05; done")
    _stub(bin_dir, "sluice", f'{record}\nexit "${{SLUICE_RC:-0}}"')
    return {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "RAY": str(bin_dir / "ray"),
        "PYTHON": str(bin_dir / "python"),
        "SLUICE": str(bin_dir / "sluice"),
        "SLURM_JOB_NODELIST": "node[1-3]",
        "SLURM_JOB_ID": "77",
        "SLURM_CPUS_PER_TASK": "4",
    }


@pytest.mark.parametrize("rc", [0, 1])
def test_slurm_ray_script_starts_a_cluster_runs_sluice_ray_and_stops_it(tmp_path, rc, process_reaper):
    """Run the script with stand-ins: the head on the first node, workers on the others, a
    wait for all three nodes, `sluice ray` against the head (a valid command line for the
    config), the Ray steps stopped afterwards and the run's exit code passed on."""
    assert subprocess.run(["bash", "-n", str(SLURM_RAY)]).returncode == 0
    env = _slurm_ray_stubs(tmp_path) | {"SLUICE_RC": str(rc), "CONFIG": "configs/quickstart.yaml"}
    proc = subprocess.Popen(
        ["bash", str(SLURM_RAY)], cwd=tmp_path, env=env, stderr=subprocess.PIPE, start_new_session=True
    )
    process_reaper.append(proc)  # the stand-ins too, if the script hangs
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == rc, err.decode()
    calls = (tmp_path / "calls.log").read_text().splitlines()
    head = "ray start --head --block --node-ip-address=10.0.0.1 --port=6379 --num-cpus=4"
    workers = "ray start --block --address=10.0.0.1:6379 --num-cpus=4"
    assert head in calls and workers in calls
    _check_ray_start(head, workers)
    assert "srun --nodes=2 --ntasks=2 --exclude=node1 " + env["RAY"] + " " + workers[4:] in calls
    assert "python - 10.0.0.1:6379 3 300" in calls
    (sluice_line,) = [c for c in calls if c.startswith("sluice ")]
    assert calls.index(sluice_line) > calls.index("python - 10.0.0.1:6379 3 300")
    assert calls[-2:] == ["ray stopped", "ray stopped"]  # both steps, after the run
    command, params = parse_cli(shlex.split(sluice_line)[1:])
    assert command == "ray" and params["no_progress"]
    cfg = load_config(ROOT / params["config"], params["overrides"])
    assert cfg.ray.address == "10.0.0.1:6379" and cfg.run.dir == f"{tmp_path}/runs/slurm-ray-77"


def _check_ray_start(*lines: str) -> None:
    """The `ray start` command lines parse with Ray's own CLI (when Ray is installed)."""
    scripts = pytest.importorskip("ray.scripts.scripts")
    start = scripts.cli.get_command(click.Context(scripts.cli), "start")
    for line in lines:
        start.make_context("ray start", shlex.split(line)[2:])


def test_slurm_ray_script_waits_for_every_node(tmp_path):
    """The script's Python part, run against a stand-in `ray` module: it retries until the head
    answers, then waits until the allocation's nodes are alive."""
    script = re.search(r"<<'PY'\n(.*?)\nPY\n", SLURM_RAY.read_text(), re.S).group(1)
    fake = tmp_path / "ray"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "calls = {'init': 0, 'nodes': 0}\n"
        "def init(address, logging_level):\n"
        "    calls['init'] += 1\n"
        "    if calls['init'] < 3:\n"
        "        raise ConnectionError('no head yet')\n"
        "def shutdown():\n    pass\n"
        "def nodes():\n"
        "    calls['nodes'] += 1\n"
        "    return [{'Alive': True}] * min(calls['nodes'], 3)\n"
    )
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    args = [sys.executable, "-c", script.replace("time.sleep(2)", "time.sleep(0)")]
    ok = subprocess.run([*args, "10.0.0.1:6379", "3", "5"], env=env, capture_output=True, text=True)
    assert ok.returncode == 0 and "3 nodes at 10.0.0.1:6379" in ok.stdout, ok.stderr
    short = subprocess.run([*args, "10.0.0.1:6379", "4", "0.2"], env=env, capture_output=True, text=True)
    assert short.returncode == 1 and "3 of 4 Ray nodes joined" in short.stderr
