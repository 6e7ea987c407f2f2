"""The role fork server's last preload (sluice/launch/forkserver.py). Importing a module is the
only way to run code in the standard library's fork server, so this one does two things there.

It freezes the heap the imports built, as every role does once it is built (`freeze_startup_heap`,
docs/architecture.md, "Start-up objects leave the collector's full passes"): the roles forked
from the server then find those objects frozen already, a forked role's own freeze collects only
what it built, and its collector never walks the imported modules' objects. Walking them took
1.4-1.8 s of each forked role's CPU on the quickstart (measured), and it writes every object's
header, which copies the server's pages into each role.

And it ends the server without the interpreter's teardown, as `exit_process` ends a role:
triton's bindings, which torch imports, print hundreds of lines of "leaked" objects to the
launcher's terminal when an interpreter that imported them is torn down.
"""

import atexit
import os

from sluice.launch.heap import freeze_startup_heap

SERVER_PID = os.getpid()
FROZEN = freeze_startup_heap()


def _exit_at_once() -> None:
    if os.getpid() == SERVER_PID:  # the server only: a fork never runs this (it ends in os._exit)
        os._exit(0)


atexit.register(_exit_at_once)
