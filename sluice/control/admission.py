"""Admission control: do not start work that would be too stale when consumed.

AReaL's rule, over all rollout services together: a sample may start only while

    started <= (v + max_staleness + 1) * batch_size

where `started` counts every sample ever admitted (minus refunds) and `v` is the version the
admitted work is generated with at least: the newest published weights (every receiver has
them), or, where newer, the newest announced to the asking service's receiver (a member of the
current epoch) or reported verified by it (the control server decides which,
`ControlServer._weights_for`; the service takes those weights before it generates). The
learner consumes `batch_size` samples per version, so, consumed in admission order, a sample
admitted under this rule is consumed at the latest at version v + max_staleness: it is never
too stale, and rollouts pause instead of generating samples that would be dropped. (A
straggler overtaken by faster services can still age past the bound; the learner's
`min_version` filter catches it.)

Quota comes back when admitted samples will never be consumed: refunds (a service aborted or
filtered them), `release` (the buffer or the learner dropped them as stale), and `forget` (the
service is gone: what it was admitted but did not deliver). `forget` must be exact: quota given
back for samples that were in fact delivered lets that many more samples be in flight than the
bound for the rest of the run (each of them, dropped as stale, gives its quota back again), so
the control server credits a dead service with the most it is known to have delivered (its
newest ADMIT or heartbeat, or its samples that reached the learner).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class AdmissionPolicy:
    batch_size: int  # learner samples per version
    max_staleness: int
    started: int = 0
    refused_asks: int = 0
    released_gone: int = 0  # samples given back by `forget`
    per_service: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def quota(self, version: int) -> int:
        return (version + self.max_staleness + 1) * self.batch_size

    def admit(self, service_id: str, n: int, group_size: int, version: int) -> int:
        """Grant up to `n` samples in whole groups; 0 means wait."""
        if n <= 0 or group_size <= 0:
            raise ValueError(f"n={n} and group_size={group_size} must be positive")
        room = max(0, self.quota(version) - self.started)
        granted = min(n, room) // group_size * group_size
        if granted == 0:
            self.refused_asks += 1
        self.started += granted
        self.per_service[service_id] += granted
        return granted

    def release(self, n: int) -> None:
        """Samples that were admitted but will never be consumed (dropped as stale by the
        buffer or the learner) no longer count as started: without this, a run whose samples
        were dropped would wait forever for quota that is held by nothing."""
        self.started = max(0, self.started - n)

    def charge(self, n: int) -> None:
        """Samples consumed once that came back into flight (a trained lease was gone at its
        ACK: a restarted shard or an expired lease queued them again) count as started again:
        each of them is dropped (and released) or consumed a second time (skipped), and either
        would otherwise free quota that nothing holds."""
        self.started += n

    def refund(self, service_id: str, n: int) -> None:
        n = min(n, self.per_service[service_id])
        self.started -= n
        self.per_service[service_id] -= n

    def forget(self, service_id: str, delivered: int) -> int:
        """The service is gone; what it was admitted beyond what it delivered never will be.
        Returns the samples released."""
        held = self.per_service.pop(service_id, 0)
        n = max(0, held - max(0, delivered))
        self.started = max(0, self.started - n)
        self.released_gone += n
        return n
