"""The `sluice` command line. Entry points are thin: parse the config, import the role's
modules, call `run_<role>`.

    sluice run CONFIG [key=value ...]                 every role on this machine (the main job)
    sluice buffer CONFIG --shard K [key=value ...]    one buffer shard
    sluice rollout CONFIG --index I [key=value ...]   one rollout service
    sluice learner CONFIG [--policy P] [key=value ...] one rank of a learner group
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from sluice.config.loader import ConfigError, load_config
from sluice.config.run import RunConfig
from sluice.launch.role import EXIT_CONFIG, run_role

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False)

ConfigArg = Annotated[str, typer.Argument(help="YAML run config")]
OverridesArg = Annotated[list[str] | None, typer.Argument(help="dotted overrides, e.g. learner.lr=1e-4")]


def _load(config: str, overrides: list[str] | None) -> RunConfig:
    try:
        return load_config(config, overrides or [])
    except ConfigError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(EXIT_CONFIG) from None


def _validate_plugins(cfg: RunConfig) -> None:
    """Fail before starting processes if the task (or environment) config is wrong."""
    try:
        if cfg.rollout.kind == "env":
            from sluice.modeling.policy import env_spaces

            env_spaces(cfg.env.id, cfg.env.kwargs)
            return
        from rollout_svc.tasks.registry import build_task

        build_task(cfg.task, seed=0)
    except ConfigError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(EXIT_CONFIG) from None
    except Exception as e:  # gymnasium raises many kinds for a bad id or kwargs
        typer.echo(f"config error: env: {e}", err=True)
        raise typer.Exit(EXIT_CONFIG) from None


@app.command()
def run(
    config: ConfigArg,
    overrides: OverridesArg = None,
    no_progress: Annotated[bool, typer.Option(help="plain output, no progress bar")] = False,
) -> None:
    """Start buffer shards, rollout services and the learner as processes on this machine."""
    cfg = _load(config, overrides)
    _validate_plugins(cfg)
    from sluice.launch.local import run_local
    from sluice.launch.role import quiet_libraries

    quiet_libraries()

    raise typer.Exit(run_local(cfg, show_progress=not no_progress))


@app.command()
def buffer(
    config: ConfigArg,
    overrides: OverridesArg = None,
    shard: Annotated[int, typer.Option(help="shard index")] = 0,
) -> None:
    """Serve one buffer shard."""
    cfg = _load(config, overrides)
    from buffer.service import run_buffer

    raise typer.Exit(run_role(f"buffer-{shard}", lambda stop: run_buffer(cfg, shard, stop)))


@app.command()
def rollout(
    config: ConfigArg,
    overrides: OverridesArg = None,
    index: Annotated[int, typer.Option(help="rollout service index")] = 0,
) -> None:
    """Run one rollout service (`rollout.kind` llm: LLM generation; env: gymnasium envs)."""
    cfg = _load(config, overrides)
    _validate_plugins(cfg)
    if cfg.rollout.kind == "env":
        from rollout_svc.env_service import run_env_rollout as run_rollout
    else:
        from rollout_svc.service import run_rollout

    raise typer.Exit(run_role(f"rollout-{index}", lambda stop: run_rollout(cfg, index, stop)))


@app.command()
def learner(
    config: ConfigArg,
    overrides: OverridesArg = None,
    policy: Annotated[
        str | None, typer.Option(help="policy id (default: the first of learner.policies)")
    ] = None,
) -> None:
    """Run one rank of a learner group (RANK/WORLD_SIZE/MASTER_* from the environment, as
    torchrun sets them; unset: a group of one)."""
    import os

    from sluice.config.policy import learner_role, policy_index

    cfg = _load(config, overrides)
    policy_id = policy or cfg.learner.policies[0]
    try:
        policy_index(cfg, policy_id)
    except ValueError as e:
        typer.echo(f"config error: --policy: {e}", err=True)
        raise typer.Exit(EXIT_CONFIG) from None
    from learner.loop import run_learner

    role = learner_role(cfg, policy_id, int(os.environ.get("RANK", "0")))
    raise typer.Exit(run_role(role, lambda stop: run_learner(cfg, stop, policy_id)))


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
