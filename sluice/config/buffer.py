"""Buffer shards: where they listen and how they hold experience."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sluice.config.base import Section


class BufferConfig(Section):
    shards: int = Field(1, ge=1)
    """Number of shard servers; groups are placed by hash(group_id) % shards."""
    mode: Literal["fifo"] = "fifo"
    """fifo: consume-once under leases (ACK deletes, lease timeout or NACK redelivers)."""
    capacity: int = Field(65536, ge=1)
    """Trajectories a shard holds (queued + leased) before it refuses PUT with retry-after."""
    lease_timeout_s: float = Field(60.0, gt=0)
    """A lease not ACKed within this time is returned to the queue."""
    max_message_bytes: int = Field(1 << 30, ge=1024)
    """ZMQ_MAXMSGSIZE of a shard: a larger message closes the sender's connection."""
    max_batch: int = Field(8192, ge=1)
    """Most trajectories in one PUT, or asked for by one GET."""
    retry_after_ms: int = Field(100, ge=1)
    """What a full shard tells producers to wait before the next PUT."""
    host: str = "127.0.0.1"
    """Host clients connect to when `endpoints` is empty."""
    base_port: int = Field(0, ge=0, le=65535)
    """Shard k listens on base_port + k. 0: the local launcher picks free ports."""
    endpoints: list[str] = []
    """Explicit client endpoints, one per shard (e.g. tcp://buffer-0:5555). Overrides host/port."""
    bind: list[str] = []
    """Explicit bind endpoints, one per shard (e.g. tcp://*:5555). Default: the endpoint."""

    def endpoint(self, shard: int) -> str:
        if self.endpoints:
            return self.endpoints[shard]
        if self.base_port == 0:
            raise ValueError("buffer.base_port is 0 and buffer.endpoints is empty: no address")
        return f"tcp://{self.host}:{self.base_port + shard}"

    def bind_endpoint(self, shard: int) -> str:
        return self.bind[shard] if self.bind else self.endpoint(shard)

    def all_endpoints(self) -> list[str]:
        return [self.endpoint(k) for k in range(self.shards)]
