"""The `sluice` command line. Entry points are thin: parse the config, import the role's
modules, call `run_<role>`.

    sluice run CONFIG [key=value ...]                 every role on this machine (the main job)
    sluice ray CONFIG [key=value ...]                 every role on a Ray cluster
    sluice buffer CONFIG [--shard K] [key=value ...]  one buffer shard
    sluice rollout CONFIG [--index I] [key=value ...] one rollout service
    sluice rollout CONFIG --index I --count N         a pack of N sim services in one process
    sluice learner CONFIG [--policy P] [key=value ...] one rank of a learner group
    sluice status CONFIG|RUN_DIR [--once] [--json]    live table of every role of a run
    sluice config CONFIG [key=value ...]              print the resolved config (checks it)
    sluice compose CONFIG [key=value ...]             a docker-compose file, one service per role
    sluice k8s CONFIG [key=value ...] [--ray]         Kubernetes manifests, one pod per role (or a RayJob)
    sluice keys DIR                                   CURVE key pairs for security.curve
    sluice export CHECKPOINT OUT_DIR                  a checkpoint as a Hugging Face model dir
    sluice plots RUN_DIR                              PNG plots of a run's metrics

The config is the YAML file, then SLUICE__SECTION__KEY environment variables, then the dotted
overrides on the command line (see sluice/config/loader.py).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from sluice.config.loader import ConfigError, load_config
from sluice.config.run import RunConfig
from sluice.config.workflow_check import preflight_workflow
from sluice.launch.plan import RoleKind
from sluice.launch.role import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, resolve_index, run_role
from sluice.learner.losses.plugin import check_loss

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False)

ConfigArg = Annotated[str, typer.Argument(help="YAML run config")]
OverridesArg = Annotated[list[str] | None, typer.Argument(help="dotted overrides, e.g. learner.lr=1e-4")]
NoProgress = Annotated[bool, typer.Option(help="plain output, no progress bar")]
PolicyOpt = Annotated[str | None, typer.Option(help="policy id (default: the first of learner.policies)")]


def _fail(message: str, code: int = EXIT_CONFIG) -> typer.Exit:
    typer.echo(message, err=True)
    return typer.Exit(code)


def _load(config: str, overrides: list[str] | None) -> RunConfig:
    try:
        return load_config(config, overrides or [], env=os.environ)
    except ConfigError as e:
        raise _fail(str(e)) from None


def _validate_plugins(cfg: RunConfig) -> None:
    """Fail before starting processes if a plugin the config names does not resolve or its
    settings are wrong: task, rewards, engine, environment (sluice/plugins.py)."""
    try:
        if cfg.workflow is None:
            check_loss(cfg.learner.loss)  # the legacy keys name no stage by reference
        else:
            preflight_workflow(cfg.workflow)
        if cfg.rollout.kind == "env":
            from sluice.modeling.policy import env_spaces

            env_spaces(cfg.env.id, cfg.env.kwargs)
            return
        from sluice.rollout_svc.engines.registry import ENGINES, user_engine
        from sluice.rollout_svc.scoring import build_rewards
        from sluice.rollout_svc.tasks.registry import build_task

        task = build_task(cfg.task, seed=0)
        build_rewards(cfg.task, task)
        if cfg.task.eval.every:
            task.held_out(cfg.task.eval.prompts)
        if cfg.rollout.engine not in ENGINES:
            user_engine(cfg.rollout.engine)
    except ConfigError as e:
        raise _fail(str(e)) from None
    except NotImplementedError as e:
        raise _fail(f"config error: task.eval.every={cfg.task.eval.every}: {e}") from None
    except Exception as e:  # gymnasium (bad id or kwargs) or a user's task raises many kinds
        where = "env" if cfg.rollout.kind == "env" else f"task.name: {cfg.task.name!r}"
        raise _fail(f"config error: {where}: {type(e).__name__}: {e}".splitlines()[0]) from None


def _index(explicit: int | None) -> int:
    try:
        return resolve_index(explicit, os.environ)
    except ConfigError as e:
        raise _fail(str(e)) from None


@app.command()
def run(config: ConfigArg, overrides: OverridesArg = None, no_progress: NoProgress = False) -> None:
    """Start buffer shards, rollout services and the learner as processes on this machine."""
    cfg = _load(config, overrides)
    _validate_plugins(cfg)
    from sluice.launch.local import run_local
    from sluice.launch.role import quiet_libraries

    quiet_libraries()

    raise typer.Exit(run_local(cfg, show_progress=not no_progress))


@app.command("ray")
def ray_(config: ConfigArg, overrides: OverridesArg = None, no_progress: NoProgress = False) -> None:
    """Start every role on a Ray cluster, one Ray actor process each, and supervise them.

    The cluster is ray.address ("auto" after `ray up`), or a local Ray instance when unset."""
    cfg = _load(config, overrides)
    _validate_plugins(cfg)
    try:
        import ray  # noqa: F401
    except ImportError:
        raise _fail("sluice ray needs Ray: pip install 'sluice[ray]'", EXIT_FAILED) from None
    from sluice.launch.ray_launcher import run_ray
    from sluice.launch.role import quiet_libraries

    quiet_libraries()
    raise typer.Exit(run_ray(cfg, show_progress=not no_progress))


# A role's index; default: SLUICE_INDEX, SLURM_PROCID, JOB_COMPLETION_INDEX, 0 (`_index`).
IndexOpt = Annotated[
    int | None, typer.Option(help="index (default: SLUICE_INDEX, SLURM_PROCID, JOB_COMPLETION_INDEX, 0)")
]


def _run_planned(cfg: RunConfig, kind: RoleKind, index: int, policy: str | None = None) -> typer.Exit:
    """Run the role of the plan (sluice/launch/plan.py) this command stands for, then end the
    process (exit_process)."""
    from sluice.launch.plan import find_spec, run_role_spec
    from sluice.launch.role import exit_process

    try:
        spec = find_spec(cfg, kind, index, policy)
    except ValueError as e:
        return _fail(f"config error: {e}")
    exit_process(run_role(spec.name, lambda stop: run_role_spec(cfg, spec, stop)))


@app.command()
def buffer(config: ConfigArg, overrides: OverridesArg = None, shard: IndexOpt = None) -> None:
    """Serve one buffer shard."""
    raise _run_planned(_load(config, overrides), "buffer", _index(shard))


CountOpt = Annotated[
    int | None,
    typer.Option(help="sim services to run in this process, --index .. --index+count-1 (a pack)"),
]


@app.command()
def rollout(
    config: ConfigArg, overrides: OverridesArg = None, index: IndexOpt = None, count: CountOpt = None
) -> None:
    """Run one rollout service (`rollout.kind` llm: LLM generation; env: gymnasium envs), or
    with --count N a pack of N sim services in one process (docs/architecture.md, "Packed sim
    services"). Without --count: the plan's role at --index (a pack with
    rollout.sim.services_per_process > 1)."""
    cfg = _load(config, overrides)
    _validate_plugins(cfg)
    if count is None:
        raise _run_planned(cfg, "rollout", _index(index))
    from sluice.launch.plan import pack_spec, run_role_spec
    from sluice.launch.role import exit_process
    from sluice.rollout_svc.pack import check_packable

    try:
        check_packable(cfg, count)
    except ConfigError as e:
        raise _fail(str(e)) from None
    spec = pack_spec(cfg, _index(index), count)
    exit_process(run_role(spec.name, lambda stop: run_role_spec(cfg, spec, stop)))


@app.command()
def learner(
    config: ConfigArg,
    overrides: OverridesArg = None,
    policy: PolicyOpt = None,
) -> None:
    """Run one rank of a learner group (RANK/WORLD_SIZE/MASTER_* from the environment, as
    torchrun sets them; unset: a group of one)."""
    cfg = _load(config, overrides)
    if policy is not None and policy not in cfg.learner.policies:
        raise _fail(f"config error: --policy: {policy!r} is not in learner.policies={cfg.learner.policies}")
    raise _run_planned(cfg, "learner", int(os.environ.get("RANK", "0")), policy)


OutOpt = Annotated[str | None, typer.Option(help="write here instead of stdout")]


def _emit(text: str, out: str | None) -> None:
    if out is None:
        typer.echo(text, nl=False)
    else:
        Path(out).write_text(text)


def _shown_as(config: str, overrides: list[str] | None) -> str:
    """How a generated file's header names the command that made it."""
    return " ".join(["configs/" + Path(config).name, *(overrides or [])])


@app.command()
def compose(
    config: ConfigArg,
    overrides: OverridesArg = None,
    config_path: Annotated[
        str | None, typer.Option(help="the config's path inside the containers (default /app/configs/<name>)")
    ] = None,
    out: OutOpt = None,
) -> None:
    """A docker-compose file with one service per process of the config's role plan."""
    from sluice.launch.compose import compose_text

    cfg = _load(config, overrides)
    inside = config_path or f"/app/configs/{Path(config).name}"
    _emit(compose_text(cfg, inside, shown_as=_shown_as(config, overrides)), out)


@app.command()
def k8s(
    config: ConfigArg,
    overrides: OverridesArg = None,
    ray: Annotated[bool, typer.Option("--ray", help="a KubeRay RayJob running `sluice ray` instead")] = False,
    image: Annotated[
        str | None, typer.Option(help="container image (default sluice:dev, with --ray sluice:ray)")
    ] = None,
    out: OutOpt = None,
) -> None:
    """Kubernetes manifests: one pod per process of the config's role plan (docs/deploy.md)."""
    from sluice.launch.k8s import k8s_text
    from sluice.launch.rayjob import rayjob_text

    cfg = _load(config, overrides)
    shown_as = _shown_as(config, overrides)
    try:
        if ray:
            text = rayjob_text(cfg, shown_as, image or "sluice:ray")
        else:
            text = k8s_text(cfg, shown_as, image or "sluice:dev")
    except ValueError as e:
        raise _fail(f"config error: {e}") from None
    _emit(text, out)


@app.command()
def status(
    target: Annotated[str, typer.Argument(help="run directory (its resolved config.yaml) or a config file")],
    overrides: OverridesArg = None,
    once: Annotated[bool, typer.Option(help="print one table and exit (for scripts)")] = False,
    json: Annotated[bool, typer.Option("--json", help="print one JSON snapshot and exit")] = False,
    interval: Annotated[float, typer.Option(help="seconds between refreshes")] = 2.0,
    timeout: Annotated[float, typer.Option(help="seconds to wait for each role")] = 2.0,
) -> None:
    """Live table of every role of a running run: version, throughput, staleness, fill, lag.

    With --once or --json the exit code is 0 when the learner answered, 1 when it did not."""
    path = Path(target)
    cfg = _load(str(path / "config.yaml") if path.is_dir() else target, overrides)
    if cfg.control.port == 0:
        raise _fail(
            "control.port is 0 in this config: pass the run directory (its config.yaml has the ports)"
        )
    from rich.console import Console
    from rich.live import Live

    from sluice.launch.status import collect, render

    title = f"sluice status: {cfg.run.dir or target}"
    if once or json:
        snap = collect(cfg, timeout)
        if json:
            typer.echo(snap.to_json())
        else:
            Console(width=200).print(render(snap, title))
        raise typer.Exit(EXIT_OK if snap.learner_reachable else EXIT_FAILED)
    console = Console()
    try:
        if not console.is_terminal:
            console = Console(width=200)  # a log or a pipe: one table per refresh, appended
            while True:
                console.print(render(collect(cfg, timeout), f"{title} at {time.strftime('%H:%M:%S')}"))
                time.sleep(interval)
        with Live(render(collect(cfg, timeout), title), console=console, refresh_per_second=1) as live:
            while True:
                time.sleep(interval)
                live.update(render(collect(cfg, timeout), title))
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_OK) from None


@app.command()
def config(config: ConfigArg, overrides: OverridesArg = None) -> None:
    """Print the config a role would run with (file, environment, overrides), or its error."""
    cfg = _load(config, overrides)
    import yaml

    typer.echo(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), nl=False)


@app.command()
def keys(
    directory: Annotated[str, typer.Argument(help="where to write the key pairs")],
    overwrite: Annotated[bool, typer.Option(help="replace existing keys")] = False,
) -> None:
    """Make CURVE key pairs (server and client) for security.curve.

    Enable them with `security.curve: true` and `security.keys_dir: DIR` in the config."""
    from sluice.security import generate_keys

    try:
        made = generate_keys(directory, overwrite=overwrite)
    except FileExistsError as e:
        raise _fail(str(e)) from None
    typer.echo(
        f"wrote {made.server_public.name}, {made.server_secret.name}, {made.client_public.name}, "
        f"{made.client_secret.name} and {made.authorized.name}/ in {made.directory}\n"
        f"enable with: security.curve=true security.keys_dir={made.directory.resolve()}\n"
        "servers need server.key_secret and authorized/; clients need server.key and client.key_secret"
    )


@app.command()
def export(
    checkpoint: Annotated[str, typer.Argument(help="checkpoint dir, checkpoints/ dir, or run dir (latest)")],
    out_dir: Annotated[str, typer.Argument(help="Hugging Face model directory to write")],
    dtype: Annotated[str | None, typer.Option(help="cast weights: float32 or bfloat16")] = None,
    overwrite: Annotated[bool, typer.Option(help="replace a non-empty OUT_DIR")] = False,
) -> None:
    """Write a checkpoint as a Hugging Face model directory (model and tokenizer only)."""
    from sluice.export import ExportError, export_checkpoint

    try:
        out = export_checkpoint(checkpoint, out_dir, dtype=dtype, overwrite=overwrite)
    except ExportError as e:
        raise _fail(str(e)) from None
    typer.echo(f"exported to {out}")


@app.command()
def experience(
    run_dir: Annotated[str, typer.Argument(help="run directory")],
    out: Annotated[str, typer.Argument(help="Parquet file, or (--format hf) dataset directory, to write")],
    format: Annotated[str, typer.Option(help="parquet or hf (a Hugging Face dataset directory)")] = "parquet",
) -> None:
    """Write every trajectory the run's shards stored, with its fate (acked, dropped, evicted,
    held): complete for runs with buffer.archive=true."""
    from sluice.experience import export_experience

    if format not in ("parquet", "hf"):
        raise _fail(f"--format {format!r}: expected parquet or hf")
    try:
        summary = export_experience(run_dir, out, format)  # type: ignore[arg-type]
    except FileNotFoundError as e:
        raise _fail(str(e)) from None
    fates = ", ".join(f"{k} {v}" for k, v in sorted(summary.fates.items()))
    typer.echo(f"{summary.rows} trajectories from {summary.shards} shards ({fates}) -> {summary.path}")


@app.command()
def plots(run_dir: Annotated[str, typer.Argument(help="run directory")]) -> None:
    """Write PNG plots of a run's metrics (reward, staleness, throughput) to RUN_DIR/plots."""
    from sluice.plots import write_run_plots

    if not Path(run_dir).is_dir():
        raise _fail(f"{run_dir!r} is not a directory")
    written = write_run_plots(run_dir)
    if not written:
        raise _fail(f"{run_dir!r} has no metrics to plot", EXIT_FAILED)
    for p in written:
        typer.echo(str(p))


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
