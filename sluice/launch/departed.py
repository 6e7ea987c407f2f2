"""What a launcher tells the learners when it sees a rollout process die (kill -9, a crash).

The weight-sync group would find out by itself: the dead receiver's heartbeat stops, and after
`weight_sync.liveness_timeout_s` the learner abandons the epoch and forms a new one without it
(docs/architecture.md, Weight sync, "Failures never hang the learner"). The launcher knows at
once, so it LEAVEs the process's services on every learner's control plane, by pid: a publish
waiting for the dead member's report then counts it as gone, and the next epoch is formed
without it. Both `sluice run` and `sluice ray` call it before they start the replacement, so
the replacement (which JOINs later, with its own pid) is never taken out, even where its pid is
the dead one's (another node, another container). Best effort: a learner that does not answer
within `timeout_s` is left to its heartbeat watch.
"""

from __future__ import annotations

import logging

from sluice.config.policy import policy_view
from sluice.config.rollout import rollout_service_id
from sluice.config.run import RunConfig
from sluice.launch.plan import RoleSpec

log = logging.getLogger(__name__)


def service_ids(spec: RoleSpec) -> list[str]:
    """The weight-sync service ids of a rollout process (one, or each of a pack's)."""
    return [rollout_service_id(i) for i in range(spec.index, spec.index + spec.count)]


def leave_for_dead(cfg: RunConfig, spec: RoleSpec, pid: int, timeout_s: float = 1.0) -> list[str]:
    """LEAVE, on every policy's learner, each service of rollout process `pid` (`spec`), which
    a launcher saw die. Returns "<policy>/<service>" for each membership that removed one."""
    from sluice.control.client import ControlClient
    from sluice.rpc import RpcError, RpcTimeout
    from sluice.security import secure_context

    if spec.kind != "rollout" or pid <= 0:
        return []
    removed = []
    ctx = secure_context(cfg.security, "client")  # None: each client makes a plain one
    try:
        for policy in cfg.learner.policies:
            endpoint = policy_view(cfg, policy).control.endpoint
            client = ControlClient(endpoint, timeout_s=timeout_s, ctx=ctx)
            try:
                for sid in service_ids(spec):
                    if client.leave(sid, pid=pid).removed:
                        removed.append(f"{policy}/{sid}")
            except (RpcTimeout, RpcError) as e:  # no membership there, or no answer: the heartbeat decides
                log.info("LEAVE of dead %s (pid %d) at %s not taken: %s", spec.name, pid, endpoint, e)
            finally:
                client.close()
    finally:
        if ctx is not None:
            ctx.term()
    return removed
