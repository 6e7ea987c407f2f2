"""The Ray driver waits for each role's last log lines before it disconnects.

Ray streams a worker's stdout/stderr to the driver through its log monitor (file tail, GCS
pub/sub, a driver thread), a second or so behind the worker. `ray.shutdown()` stops that thread
at once, so the lines a role writes as the run ends (often all a rollout service writes in a
short run, or the traceback of a role that failed) were cut. Each role now ends its `run` with
one `ROLE_ENDED` line on stderr; the driver sees every forwarded batch through Ray's stream
dispatcher and waits, bounded, until that line has come from every role whose process still
wrote it. docs/architecture.md ("Ray launcher") has the shutdown order.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

ROLE_ENDED = "sluice role ended:"
HANDLER_NAME = "sluice_role_ends"
log = logging.getLogger(__name__)


def write_role_ended(name: str, outcome: str) -> None:
    """The last line a role's process writes for the driver (stderr, whatever the log level)."""
    sys.stderr.write(f"{ROLE_ENDED} {name} ({outcome})\n")
    sys.stderr.flush()


class RoleEndWatch:
    """Records the pids whose `ROLE_ENDED` line reached this driver."""

    def __init__(self) -> None:
        self._ended: set[int] = set()
        self._cond = threading.Condition()
        self._dispatcher: Any = None

    def attach(self) -> bool:
        """Listens to the lines Ray forwards to this driver. False, with a debug line, where this
        Ray has no stream dispatcher (private API; the driver then only loses the wait)."""
        try:
            from ray._private.ray_logging import global_worker_stdstream_dispatcher
        except ImportError:
            log.debug("ray has no stream dispatcher: shutdown does not wait for the roles' last lines")
            return False
        self._dispatcher = global_worker_stdstream_dispatcher
        self._dispatcher.add_handler(HANDLER_NAME, self._on_batch)
        return True

    def detach(self) -> None:
        if self._dispatcher is not None:
            self._dispatcher.remove_handler(HANDLER_NAME)
            self._dispatcher = None

    def _on_batch(self, data: dict[str, Any]) -> None:
        if any(ROLE_ENDED in line for line in data.get("lines") or ()):
            with self._cond:
                self._ended.add(data.get("pid"))  # type: ignore[arg-type]
                self._cond.notify_all()

    def wait_for(self, pids: set[int], timeout_s: float) -> set[int]:
        """Waits until every pid's end line arrived or `timeout_s` passed; returns the pids still
        missing (empty when every line came)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not pids <= self._ended:
                left = deadline - time.monotonic()
                if left <= 0 or self._dispatcher is None:
                    break
                self._cond.wait(left)
            return pids - self._ended
