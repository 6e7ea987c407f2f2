"""Where the control plane (admission, heartbeats, status) listens."""

from __future__ import annotations

from pydantic import Field

from sluice.config.base import Section


class ControlConfig(Section):
    host: str = "127.0.0.1"
    """Host rollouts and `sluice status` connect to (learner rank 0 serves it)."""
    port: int = Field(default=0, ge=0, le=65535)
    """Port of the control server. 0: the local launcher picks a free port."""
    bind: str | None = None
    """Bind endpoint (e.g. tcp://*:5600). Default: tcp://host:port."""
    admission: bool = True
    """Rollouts ask before starting samples, so none is started that would be too stale
    when consumed (AReaL's rule; see sluice/control/admission.py)."""
    admit_wait_ms: int = Field(default=500, ge=0)
    """A rollout refused quota waits at the control server up to this long and is answered the
    moment quota frees up (a long poll); 0: it sleeps the server's retry_after_ms and asks again."""
    heartbeat_s: float = Field(default=2.0, gt=0)
    """How often roles report their live numbers."""
    service_timeout_s: float = Field(default=30.0, gt=0)
    """A rollout service silent this long is gone (killed, crashed): the quota it was admitted
    for and did not deliver goes back, so the other services keep going. Keep it well above
    heartbeat_s."""
    learner_patience_s: float = Field(default=300.0, ge=0)
    """How long a rollout service keeps asking a learner that does not answer an ADMIT or a
    REFUND (paused by a GC, a slow checkpoint, a debugger, SIGSTOP) before it gives up and
    exits. Re-sent requests carry the same sequence number, so the learner grants or refunds
    each once. 0: no retry (the first time-out ends the service)."""

    @property
    def endpoint(self) -> str:
        if self.port == 0:
            raise ValueError("control.port is 0: no address (the local launcher sets one)")
        return f"tcp://{self.host}:{self.port}"

    @property
    def bind_endpoint(self) -> str:
        return self.bind or self.endpoint
