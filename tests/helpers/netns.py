"""Hosts for the multi-host tests: network namespaces joined by veth pairs on a bridge
(sluice/testing/netns.py), each a place to start role processes at an address of its own. A
test that cannot make namespaces here (not root, no `ip netns`) is skipped, saying why."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import pytest

from helpers import procs
from sluice.testing.netns import Host, Lab, unavailable


@contextmanager
def lab(labels: Sequence[str]) -> Iterator[Lab]:
    """A `Lab` of one namespace per label, deleted on leaving (also on failure, after killing
    what still runs in it); skips the test where namespaces cannot be made."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    with Lab(labels) as made:
        yield made


def start_in(
    host: Host,
    args: Sequence[str],
    reaper: list[subprocess.Popen],
    *,
    stdout: int | IO[Any] | None = subprocess.PIPE,
    private_dirs: Sequence[Path] = (),
    **extra_env: str,
) -> subprocess.Popen:
    """`python ARGS` in `host`'s namespace (helpers.procs.start: its own session, registered with
    the `process_reaper` fixture), with a private tmpfs over each of `private_dirs` and
    GLOO_SOCKET_IFNAME naming the host's interface (gloo's default device would take the
    address the machine's host name resolves to, which no namespace has)."""
    env = {"GLOO_SOCKET_IFNAME": host.ifname, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra_env}
    return procs.start(args, reaper, stdout=stdout, prefix=host.wrap(private_dirs), **env)


SHARD_STATS = """
import json, sys
from sluice.buffer.client import BufferClient
with BufferClient(sys.argv[1:], timeout_s=10, same_host="zmq") as client:
    print(json.dumps([reply.stats for reply in client.stats()]))
"""


def shard_stats(host: Host, endpoints: Sequence[str]) -> list[dict[str, int]]:
    """Each shard's STATS, asked from `host`'s namespace (the test's own has no route there)."""
    proc = subprocess.run(
        [*host.wrap(), sys.executable, "-c", SHARD_STATS, *endpoints],
        env=procs.child_env(),
        cwd=procs.ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)
