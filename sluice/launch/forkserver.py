"""Role processes forked from a server that imported torch and transformers once.

Every role of `sluice run` that holds a model imports torch and transformers' model classes
before its first step: ~5 s of CPU each, three at once for the quickstart on a 2-core machine,
and again for every restart. With `run.start_method: forkserver` the launcher starts Python's
multiprocessing fork server with those modules imported (`PRELOAD`), and each such role is a
fork of it that pays only for its own config, model and sockets (docs/architecture.md, "Local
launcher"). Why the standard library's server rather than our own: it already forks, reaps,
and reports each child's exit status (a signal as a negative code, as `subprocess` does).

A forked role runs the same program as a spawned one, `sluice.cli` with the role's arguments:
it starts its own session, takes the environment the spawned command would get, writes its log
to the same file, and shows `python -m sluice.cli <args>` in ps (setproctitle). Buffer shards
are spawned as before (they import neither library, and start while the server imports).
"""

from __future__ import annotations

import importlib
import io
import multiprocessing
import os
import subprocess
import sys
from multiprocessing import forkserver
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Protocol

from sluice.accelerators import cpu_only
from sluice.config.run import RunConfig
from sluice.launch.plan import RoleSpec
from sluice.rollout_svc.engines.registry import resolve_engine

# What every forked role finds imported: the CLI, torch and transformers' model classes (through
# the model builder), and each role's main module with what it imports at the top.
PRELOAD = (
    "sluice.cli",
    "sluice.modeling.tiny",
    "sluice.learner.loop",
    "sluice.learner.backends.ddp",
    "sluice.rollout_svc.service",
    "sluice.rollout_svc.engines.hf",
    "sluice.rollout_svc.env_service",
    "sluice.rollout_svc.pack",
    "sluice.rollout_svc.agents",
    "sluice.launch.preload_done",  # last: freezes what the others built
)
ENTRY_POINT = "sluice.cli"  # whose main() a forked role runs (pyproject.toml's `sluice` script)


class RoleProcess(Protocol):
    """What the launcher asks of a role's process: `subprocess.Popen`'s part it uses."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def uses_forkserver(cfg: RunConfig) -> bool:
    """`run.start_method`; `auto`: the fork server on Linux where torch can compute on the CPU
    only (sluice/accelerators.py): a process forked from one that touched CUDA cannot use it,
    and this path has run on CPUs only."""
    method = cfg.run.start_method
    if method != "auto":
        return method == "forkserver"
    return sys.platform.startswith("linux") and cpu_only()


def forked(cfg: RunConfig, spec: RoleSpec) -> bool:
    """Whether the launcher forks `spec` from the server: a learner rank or a rollout service,
    but not one whose engine is vLLM (it starts and manages processes of its own)."""
    if spec.kind == "buffer" or not uses_forkserver(cfg):
        return False
    return not (
        spec.kind == "rollout" and cfg.rollout.kind == "llm" and resolve_engine(cfg.rollout.engine) == "vllm"
    )


class ForkedRole:
    """A role forked by the server, seen through `RoleProcess`."""

    def __init__(self, process: BaseProcess) -> None:
        self._process = process

    @property
    def pid(self) -> int:
        pid = self._process.pid
        assert pid is not None, "started"
        return pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(f"role pid {self.pid}", timeout or 0.0)
        return code


class RoleForker:
    """The launcher's fork server: started on the first `start`, stopped by `close`."""

    def __init__(self) -> None:
        self._started = False

    def start(self, args: list[str], env: dict[str, str], log_path: Path) -> ForkedRole:
        """Fork `python -m sluice.cli *args` with `env`, stdout and stderr appended to `log_path`."""
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        process = ctx.Process(
            target=run_forked_role, args=(args, env, str(log_path)), name=" ".join(args[:3])
        )
        process.start()
        self._started = True
        return ForkedRole(process)

    def close(self) -> None:
        """Stop the server once every role it forked is gone (their exits are reaped by it).
        The standard library stops it only at the launcher's exit; a test or a tool that runs
        several launchers in one process would keep it (and its ~0.5 GB) otherwise."""
        if self._started:
            stop = getattr(forkserver._forkserver, "_stop", None)  # private, in 3.10-3.14
            if stop is not None:
                stop()
            self._started = False


def run_forked_role(args: list[str], env: dict[str, str], log_path: str) -> None:
    """The forked child: become the role's own process, then run the `sluice` entry point with
    the role's arguments, as the spawned `python -m sluice.cli` would."""
    from setproctitle import setproctitle

    setproctitle(" ".join([sys.executable, "-m", "sluice.cli", *args]))  # before environ changes
    _let_the_server_go()
    os.setsid()  # its own session and process group, as `start_new_session` gives a spawned one
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # PYTHONUNBUFFERED in `env` came too late for the server's streams: line by line, as it asks
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)
    sys.argv = ["sluice", *args]
    # by name, as the console script names it: the CLI is what starts this launcher
    importlib.import_module(ENTRY_POINT).main()


def _let_the_server_go() -> None:
    """Close the fork's copy of the server's "alive" pipe (the standard library hands every fork
    the writing end, so that it may start processes through the same server). The server ends
    when every writer is gone; its forks end when it does (their parent-death signal). With the
    copies open, neither would ever go first, and a launcher killed by SIGKILL left every
    forked role running (tests/test_e2e_local.py)."""
    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)  # private, the same in 3.10-3.14
    if server is not None and fd is not None:
        os.close(fd)
        server._forkserver_alive_fd = None
