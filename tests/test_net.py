"""Ports chosen before their servers exist (sluice/net.py): `HeldPorts` are held, so the kernel
hands them to no one else, and still bindable by the role's own servers (ZeroMQ, torch's
TCPStore); `free_port` draws from below the kernel's ephemeral range where there is room."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.config import load_config
from sluice.launch.local import resolve
from sluice.net import HeldPorts

CARTPOLE = Path(__file__).resolve().parents[1] / "configs" / "cartpole.yaml"

# Both scripts below start with this: the ports the kernel picks for n binds to port 0.
KERNEL_CHOICES = """
import socket

def kernel_choices(n):
    seen = set()
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            seen.add(s.getsockname()[1])
    return seen
"""

# Runs in a network namespace of its own whose ephemeral range is 8 ports wide, so that the
# kernel's choice of port is forced to cycle through them.
IN_A_SMALL_PORT_RANGE = """
import datetime, socket, zmq
from torch.distributed import TCPStore
from sluice.net import HeldPorts, ephemeral_range, free_port

def port_range(low, high):
    with open("/proc/sys/net/ipv4/ip_local_port_range", "w") as f:
        f.write(f"{low} {high}")
    assert ephemeral_range() == (low, high)

port_range(20500, 60999)  # no room below the range: free_port takes the kernel's choice
assert all(20500 <= free_port() <= 60999 for _ in range(20))
port_range(40000, 40007)
drawn = {free_port() for _ in range(20)}
assert all(20000 <= p < 40000 for p in drawn) and len(drawn) > 1, drawn

with socket.socket() as s:  # what free_port does: choose, then let go
    s.bind(("127.0.0.1", 0))
    released = s.getsockname()[1]
assert released in kernel_choices(64), "a released port is handed out again (the race)"

with HeldPorts() as held:
    store_port, zmq_port = held.take("127.0.0.1"), held.take("127.0.0.1")
    assert not {store_port, zmq_port} & kernel_choices(64), "the kernel handed out a held port"
    server = TCPStore("127.0.0.1", store_port, None, is_master=True,
                      timeout=datetime.timedelta(seconds=5), wait_for_workers=False)
    client = TCPStore("127.0.0.1", store_port, None, is_master=False, timeout=datetime.timedelta(seconds=5))
    client.set("k", "v")
    assert server.get("k") == b"v"
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(f"tcp://127.0.0.1:{zmq_port}")
    push.connect(f"tcp://127.0.0.1:{zmq_port}")
    push.send(b"frame")
    assert pull.poll(5000) and pull.recv() == b"frame"
    for sock in (pull, push):
        sock.close(linger=0)
    ctx.term()
print("ok")
"""


# The same range; a server process on a port that another process holds (as the Ray launcher's
# PortKeeper holds a role's ports) is killed: the port stays out of the kernel's choices until
# its replacement serves it there. Without the hold, the dead server's port is handed out.
A_SERVER_DIES_ON_A_HELD_PORT = """
import socket, subprocess, sys, zmq
from sluice.net import HeldPorts

with open("/proc/sys/net/ipv4/ip_local_port_range", "w") as f:
    f.write("40000 40007")
SERVE = (
    "import sys, zmq; s = zmq.Context().socket(zmq.REP); s.bind(f'tcp://127.0.0.1:{sys.argv[1]}');"
    "print('up', flush=True)\\nwhile True: s.send(s.recv())"
)

def serve_then_kill(port, ask=False):
    server = subprocess.Popen([sys.executable, "-c", SERVE, str(port)], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline() == "up\\n"
    if ask:  # it serves on that port
        ctx = zmq.Context()
        req = ctx.socket(zmq.REQ)
        req.connect(f"tcp://127.0.0.1:{port}")
        req.send(b"ping")
        assert req.poll(5000) and req.recv() == b"ping"
        req.close(linger=0)
        ctx.term()
    server.kill()
    server.wait()

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    unheld = s.getsockname()[1]
serve_then_kill(unheld)
assert unheld in kernel_choices(64), "the dead server's unheld port is handed out (the race)"

with HeldPorts() as held:
    port = held.take("127.0.0.1")
    serve_then_kill(port)  # kill -9, as a role's process dies
    assert port not in kernel_choices(64), "the kernel handed out a held port after its server died"
    serve_then_kill(port, ask=True)  # the replacement binds it again and serves
print("ok")
"""


def in_a_network_namespace(script: str) -> subprocess.CompletedProcess:
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {probe.stderr.decode().strip()}")
    return subprocess.run(
        ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$0" -c "$1"', sys.executable,
         KERNEL_CHOICES + script],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_held_ports_are_never_handed_out_and_their_servers_still_bind():
    proc = in_a_network_namespace(IN_A_SMALL_PORT_RANGE)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_a_port_held_by_another_process_outlives_its_killed_server_and_serves_its_replacement():
    proc = in_a_network_namespace(A_SERVER_DIES_ON_A_HELD_PORT)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_the_local_launcher_holds_every_port_it_chose_until_closed():
    """Every port `resolve` wrote into the config is held: a plain bind (no SO_REUSEADDR, as
    anything else on the host would) is refused while the launcher holds it."""
    cfg = load_config(CARTPOLE, ["learner.policies=[a, b]"])
    with HeldPorts() as ports:
        resolved = resolve(cfg, ports)
        chosen = [int(e.rsplit(":", 1)[1]) for e in resolved.buffer.endpoints]
        chosen += [resolved.control.port, resolved.weight_sync.master_port, resolved.learner.master_port]
        extra = resolved.learner.group_ports["b"]
        chosen += [extra.control, extra.weight_sync, extra.dist]
        assert len(set(chosen)) == len(chosen) == resolved.buffer.shards + 6
        for port in chosen:
            with socket.socket() as s, pytest.raises(OSError, match="in use"):
                s.bind(("127.0.0.1", port))
