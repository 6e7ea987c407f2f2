"""What every role process does before its main loop: logging, signals, parent-death signal.

Exit codes of role processes (and of `sluice run` / `sluice ray`), for supervisors (systemd
`RestartPreventExitStatus=2`, Kubernetes restart policies, Slurm job states):
    0    finished, or stopped on request (SIGTERM/SIGINT): do not restart
    1    failed at run time (see the log): restarting may help
    2    bad config or usage (the message names the key): restarting will not help
    130  `sluice run` / `sluice ray` interrupted (Ctrl-C)
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from typing import NoReturn

from sluice.net import raise_fd_limit
from sluice.plugins import UserCodeError

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2
EXIT_USER_CODE = 3  # a user's plugin failed (say, a reward raised with on_error=fail)


def restartable(rc: int | None) -> bool:
    """Whether a launcher should start a dead role again: not when a restart would fail the
    same way (a bad config, a user's code that raises)."""
    return rc not in (EXIT_CONFIG, EXIT_USER_CODE)


def quiet_libraries() -> None:
    """No per-file progress bars from transformers/huggingface_hub in role logs."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    # transformers reads HF_HUB_DISABLE_PROGRESS_BARS when it is imported; a role that never
    # imports it (a sim rollout service) must not pay for importing it here.
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def setup_logging(role: str, level: str | None = None) -> None:
    quiet_libraries()
    logging.basicConfig(
        level=level or os.environ.get("SLUICE_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def install_stop_handlers(stop: threading.Event) -> None:
    """SIGTERM and SIGINT set `stop`; the role's loop ends at its next check and cleans up.
    A second signal while stopping exits at once."""

    def handler(signum, frame):  # noqa: ARG001
        if stop.is_set():
            os._exit(EXIT_FAILED)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def die_with_parent() -> None:
    """Linux: get SIGTERM when the launcher dies, even by SIGKILL (no orphaned roles)."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


# Where a role's index comes from when --shard/--index is not given, in this order: our own
# variable, then the task index a scheduler gives each copy of one command (srun's task rank,
# a Kubernetes indexed Job's completion index).
INDEX_VARIABLES = ("SLUICE_INDEX", "SLURM_PROCID", "JOB_COMPLETION_INDEX")


def resolve_index(explicit: int | None, env: Mapping[str, str]) -> int:
    """The shard or service index of this process: the option, else the first of
    INDEX_VARIABLES that is set, else 0."""
    from sluice.config.loader import ConfigError

    if explicit is not None:
        if explicit < 0:
            raise ConfigError(f"index {explicit}: must be >= 0")
        return explicit
    for name in INDEX_VARIABLES:
        raw = env.get(name)
        if raw is None or raw == "":
            continue
        if not raw.strip().isdigit():
            raise ConfigError(f"{name}={raw!r}: expected a non-negative integer (the role's index)")
        return int(raw)
    return 0


def exit_process(code: int) -> NoReturn:
    """End a role's process with `code` once its main returned (every server, socket, file and
    process group closed by then): flush the logs and stdio, then `os._exit`, skipping the
    interpreter's teardown of torch, transformers and their threads (measured: ~2 s of a
    learner's exit on 2 cores, with the run waiting on it)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def run_role(role: str, main: Callable[[threading.Event], int]) -> int:
    setup_logging(role)
    stop = threading.Event()
    install_stop_handlers(stop)
    if os.environ.get("SLUICE_DIE_WITH_PARENT") == "1":
        die_with_parent()
    raise_fd_limit()  # a shard or control server with a thousand clients needs more than 1024
    try:
        return main(stop)
    except UserCodeError:
        logging.getLogger(role).exception("%s failed in user code (not restarted)", role)
        return EXIT_USER_CODE
    except Exception:
        logging.getLogger(role).exception("%s failed", role)
        return EXIT_FAILED
