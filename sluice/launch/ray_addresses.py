"""Where the Ray launcher's serving roles listen, written into the run's config.

A shard serves its endpoint, a learner group's rank 0 its control, weight-sync store and
rendezvous ports; the others must know them before they start, so the driver reserves them on
the role's node (a PortKeeper in its bundle) and writes them into the config every role is
given. The same writing serves a role that came back on another node after its node died: its
new ports and address go into the config, and the roles holding the old one are restarted
(sluice/launch/ray_launcher.py; docs/architecture.md, "Ray launcher").
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.config.learner import GroupPorts
from sluice.config.run import RunConfig
from sluice.launch.plan import RoleSpec


def reserved_ports(spec: RoleSpec) -> int:
    """How many ports a role serves on that the others must know before it starts: a shard its
    endpoint; a learner group's rank 0 its control, weight-sync store and rendezvous ports."""
    if spec.kind == "buffer":
        return 1
    return 3 if spec.kind == "learner" and spec.index == 0 else 0


@dataclass(frozen=True)
class Served:
    """A serving role's node address and the ports reserved for it there."""

    spec: RoleSpec
    ip: str
    ports: list[int]


def write_addresses(cfg: RunConfig, served: list[Served]) -> None:
    """Each served shard's endpoint (and bind), each served learner head's host and ports, into
    `cfg` in place; the other roles' addresses are left as they are."""
    shards = [s for s in served if s.spec.kind == "buffer"]
    if shards:
        endpoints = list(cfg.buffer.endpoints) or [""] * cfg.buffer.shards
        bind = list(cfg.buffer.bind) or [""] * cfg.buffer.shards
        for s in shards:
            endpoints[s.spec.index] = f"tcp://{s.ip}:{s.ports[0]}"
            bind[s.spec.index] = f"tcp://*:{s.ports[0]}"
        cfg.buffer.endpoints, cfg.buffer.bind = endpoints, bind
    for s in served:
        if s.spec.kind != "learner":
            continue
        control, store, dist = s.ports
        if s.spec.policy == cfg.learner.policies[0]:
            cfg.control.host, cfg.control.port, cfg.control.bind = s.ip, control, f"tcp://*:{control}"
            cfg.weight_sync.master_addr, cfg.weight_sync.master_port = s.ip, store
            cfg.learner.master_addr, cfg.learner.master_port = s.ip, dist
        else:
            cfg.learner.group_ports[s.spec.policy] = GroupPorts(
                control=control, weight_sync=store, dist=dist, host=s.ip
            )
