"""Hosts on one machine for multi-host tests and benchmarks: Linux network namespaces, each with
one veth interface on a bridge that lives in a namespace of its own, so that roles placed in
different namespaces talk only over a real interface (TCP through veth and bridge), never over
loopback, as they would between machines.

Everything is created inside namespaces this module makes (unique names: pid and a random
suffix) and removed on `close`: the root namespace's interfaces, routes and addresses are never
touched, and the private addresses (`SUBNET`.1, .2, ...) exist only inside the namespaces.
Deleting a namespace deletes its end of each veth pair, and with it the pair.

`enter(netns)`/`inside(netns)` move the calling thread (and what it starts from then on) into
a namespace, for benchmarks that spawn their processes. `Host.wrap(private_dirs)` runs a
command in a namespace; `ip netns exec` gives the command a
mount namespace of its own too, so a directory named there is covered by a fresh tmpfs only
that command sees: a buffer shard whose segment files are private that way cannot be reached
by the same-host data plane (clients cannot read its token file, as on another machine;
docs/architecture.md, "Buffer (same-host data plane)" and "Per-role launch"). Needs root and
`ip` (iproute2); `unavailable()` says why not.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.213.7"  # a private /24, configured only inside the namespaces made here
IFNAME = "sl0"  # each host's interface (the same name in every namespace: GLOO_SOCKET_IFNAME)
BRIDGE = "slbr0"
MAX_HOSTS = 250
CLONE_NEWNET = 0x40000000


class NetnsError(RuntimeError):
    """An `ip` command failed (its command line and stderr are in the message)."""


def ip(*args: str) -> str:
    """Run `ip ARGS`; its stdout. Raises NetnsError with ip's stderr when it fails."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {proc.stderr.strip() or f'exit {proc.returncode}'}")
    return proc.stdout


def unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, no `ip`, the kernel refuses), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"sluice-probe-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        ip("netns", "add", probe)
    except (NetnsError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot create a network namespace: {e}"
    try:
        ip("netns", "del", probe)
    except NetnsError:
        pass
    return None


@dataclass(frozen=True)
class Counters:
    """Bytes and packets an interface received and sent (the kernel's counters)."""

    rx_bytes: int
    tx_bytes: int
    rx_packets: int
    tx_packets: int


@dataclass(frozen=True)
class Host:
    """One namespace: its label (say `buffer`), namespace name and address on `IFNAME`."""

    label: str
    netns: str
    addr: str
    ifname: str = IFNAME

    def wrap(self, private_dirs: Sequence[str | Path] = ()) -> list[str]:
        """The prefix that runs a command (argv) in this namespace, with a fresh tmpfs over
        each of `private_dirs` (existing directories) seen by that command only."""
        prefix = ["ip", "netns", "exec", self.netns]
        if not private_dirs:
            return prefix
        script = 'n=$1; shift; while [ "$n" -gt 0 ]; do mount -t tmpfs sluice-private "$1" || exit 97; '
        script += 'shift; n=$((n - 1)); done; exec "$@"'
        return [*prefix, "sh", "-c", script, "sh", str(len(private_dirs)), *map(str, private_dirs)]

    def counters(self) -> Counters:
        """The kernel's counters of this host's interface."""
        link = json.loads(ip("-n", self.netns, "-j", "-s", "link", "show", "dev", self.ifname))[0]
        stats = link["stats64"]
        rx, tx = stats["rx"], stats["tx"]
        return Counters(rx["bytes"], tx["bytes"], rx["packets"], tx["packets"])

    def pids(self) -> list[int]:
        """Processes running in this namespace."""
        try:
            return [int(p) for p in ip("netns", "pids", self.netns).split()]
        except NetnsError:
            return []  # (already deleted)


class Lab:
    """Namespaces named after `labels`, each a `Host` at `SUBNET`.<i+1> on one bridge (in a
    namespace of its own). A context manager: leaving it (also on an error) kills what still
    runs in the namespaces and deletes them."""

    def __init__(self, labels: Sequence[str], subnet: str = SUBNET) -> None:
        if not 0 < len(labels) <= MAX_HOSTS or len(set(labels)) != len(labels):
            raise ValueError(f"labels must be 1 to {MAX_HOSTS} distinct names: {labels}")
        self.tag = f"sluice-{os.getpid()}-{secrets.token_hex(3)}"
        self.bridge_ns = f"{self.tag}-br"
        self.hosts: dict[str, Host] = {}
        self._made: list[str] = []  # namespaces created so far, deleted by close()
        try:
            self._add_bridge()
            for i, label in enumerate(labels):
                self.hosts[label] = self._add_host(i, label, f"{subnet}.{i + 1}")
        except BaseException:
            self.close()
            raise

    def _add_netns(self, name: str) -> None:
        ip("netns", "add", name)
        self._made.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def _add_bridge(self) -> None:
        self._add_netns(self.bridge_ns)
        ip("-n", self.bridge_ns, "link", "add", "name", BRIDGE, "type", "bridge")
        ip("-n", self.bridge_ns, "link", "set", BRIDGE, "up")

    def _add_host(self, i: int, label: str, addr: str) -> Host:
        """A namespace with lo up and `IFNAME` at `addr`/24, the veth's peer on the bridge. The
        pair is created in the bridge's namespace with its other end placed straight into the
        host's: it never exists in the root namespace."""
        host = Host(label, f"{self.tag}-{label}", addr)
        self._add_netns(host.netns)
        port, br = f"v{i}", self.bridge_ns
        ip("-n", br, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", host.netns)
        ip("-n", br, "link", "set", port, "master", BRIDGE)
        ip("-n", br, "link", "set", port, "up")
        ip("-n", host.netns, "addr", "add", f"{addr}/24", "dev", IFNAME)
        ip("-n", host.netns, "link", "set", IFNAME, "up")
        return host

    def __getitem__(self, label: str) -> Host:
        return self.hosts[label]

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, grace_s: float = 5.0) -> None:
        """Stop what still runs in the namespaces (SIGTERM, then SIGKILL after `grace_s`) and
        delete them, the bridge's last. Safe to call again."""
        hosts = list(self.hosts.values())
        _signal_all(hosts, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(h.pids() for h in hosts) and time.monotonic() < deadline:
            time.sleep(0.05)  # (waiting for processes to exit after SIGTERM)
        _signal_all(hosts, signal.SIGKILL)
        for name in reversed(self._made):
            try:
                ip("netns", "del", name)
            except NetnsError:
                pass  # (already gone)
        self._made.clear()


def _signal_all(hosts: Sequence[Host], sig: signal.Signals) -> None:
    """Send `sig` to every process in the hosts' namespaces (all started in namespaces this
    module made)."""
    for host in hosts:
        for pid in host.pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def exists(netns: str) -> bool:
    """Whether a namespace of this name exists (tests check that `close` removed them)."""
    return (Path("/run/netns") / netns).exists()


def _setns(fd: int) -> None:
    """setns(2) of the calling thread into the network namespace `fd` refers to (Python 3.11
    has no os.setns)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")


def enter(netns: str) -> None:
    """Move the calling thread into namespace `netns`: sockets it opens from then on, the
    threads it starts (a ZeroMQ context's I/O threads) and the processes it starts (as
    multiprocessing's spawn does) are in that namespace. A process that enters first thing
    is wholly there."""
    fd = os.open(Path("/run/netns") / netns, os.O_RDONLY)
    try:
        _setns(fd)
    finally:
        os.close(fd)


@contextmanager
def inside(netns: str) -> Iterator[None]:
    """The calling thread in `netns` for the block, then back where it was (its other threads
    stay where they are)."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        enter(netns)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)
