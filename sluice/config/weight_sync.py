"""How new weights travel from the learner to rollout services."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from sluice.config.base import Section


class WeightTransferConfig(Section):
    """The ZeroMQ chunked transfer: how a late joiner (or a service that fell out of the group)
    pulls the current version before it joins the broadcast group."""

    port: int = Field(default=0, ge=0, le=65535)
    """Port the learner serves snapshots on (host: weight_sync.master_addr). 0: a free port,
    advertised to receivers through the rendezvous store."""
    chunk_mb: float = Field(default=4.0, gt=0, le=512)
    """Bytes per chunk request (small tensors are coalesced into one chunk)."""
    window: int = Field(default=8, ge=1, le=256)
    """Chunk requests a receiver keeps in flight (credit-based flow control)."""
    lease_s: float = Field(default=60.0, gt=0)
    """A snapshot being pulled is kept this long after the puller's last request, even when
    newer versions are published meanwhile."""
    timeout_s: float = Field(default=30.0, gt=0)
    """A chunk not answered within this fails the pull (the receiver retries from scratch)."""


class WeightSyncConfig(Section):
    backend: Literal["auto", "gloo", "nccl", "hccl"] = "auto"
    """torch.distributed backend of the broadcast group, per membership epoch: auto = nccl
    (hccl) when the learner and every member hold their weights on CUDA (Ascend), else gloo
    (e.g. a CUDA learner with CPU rollout services: receivers with weights on an accelerator
    then receive into page-locked host buffers and copy once after verifying)."""
    every: int = Field(default=1, ge=1)
    """Publish weights after every k optimizer steps."""
    bucket_mb: float = Field(default=64.0, gt=0)
    """Parameters are flattened by dtype into buckets of about this many MiB."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """dtype on the wire and in the engine: floating-point weights are cast while packed (e.g.
    float32 master weights to bfloat16). auto: the model's dtype (model.dtype)."""
    piece_mb: float = Field(default=16.0, gt=0)
    """Each broadcast carries at most this many MiB: a bigger bucket (one tensor larger than
    bucket_mb, e.g. the embedding) is cast, sent and checksummed piece by piece, so its first
    bytes are on the wire while the rest is still being cast. 16 MiB measured best of 64/16 on a
    16-core host (benchmarks/weight_sync.py); smaller pieces also shorten the pipeline's fill
    and drain."""
    checksum: Literal["auto", "xxh3", "wsum32"] = "auto"
    """How receivers verify a broadcast: xxh3-64 per tensor of host bytes, or wsum32 per piece
    computed on the device the bytes are on (no device-to-host copy, no CPU core; a checksum
    against transport faults, not a hash). auto: xxh3 on gloo epochs, wsum32 on nccl/hccl
    epochs. Snapshots, pulls and deltas always use xxh3."""
    confirm: Literal["background", "wait"] = "background"
    """When `publish` returns. wait: once every member reported the version verified.
    background: once the learner's sends are done; the members' reports are awaited in a
    thread while the learner trains its next step, the version counts as published (admission
    follows it) when the last one arrives, and a member that fails is dealt with at the next
    publish (a new epoch, that version sent in full). Measured: 4-6 ms a step off the learner's
    critical path on the vs_trl workload (docs/architecture.md)."""
    send: Literal["background", "inline"] = "background"
    """Where a publish's broadcast runs. background: the learner packs the version into its host
    snapshot (a copy: the model may change from then on) and the confirmation thread sends it,
    awaits the members' reports and retries over a new epoch if a send fails, while the learner
    trains its next step; the next publish waits for that first. inline: the learner's own
    thread sends, overlapping packing with the wire. Needs `confirm: background`. Measured: 4-5
    ms of a 35-45 ms step off the learner's critical path on the vs_trl workload, measured when
    members still polled for the announcement (docs/architecture.md, "Cores and threads")."""
    pipeline_depth: int = Field(default=4, ge=1, le=256)
    """Pieces in flight at once: piece i+1 is cast while pieces up to i are on the wire. On
    an accelerator each in-flight piece holds its bucket's buffer on the device."""
    delta: bool = False
    """Send only tensors whose bytes changed since the previous version (frozen layers, LoRA,
    bf16 weights an update did not move). Receivers keep the rest; a receiver that does not
    hold the base version refuses the delta and pulls the whole version instead."""
    master_addr: str = "127.0.0.1"
    """Host of the rendezvous store (served by learner rank 0)."""
    master_port: int = Field(default=0, ge=0, le=65535)
    """Port of the rendezvous store. 0: the local launcher picks a free port."""
    timeout_s: float = Field(default=300.0, gt=0)
    """Rendezvous timeout: how long a receiver keeps trying to reach the learner's store and
    control server before it fails."""
    publish_timeout_s: float = Field(default=60.0, gt=0)
    """Collective timeout of the broadcast group: a member that does not take part in a
    bucket within this is dropped and the group is rebuilt without it (the learner never
    waits longer for a crashed or hung receiver)."""
    liveness_timeout_s: float = Field(default=5.0, gt=0)
    """A member that stops its heartbeat (bumped while it waits in a collective) for this long
    during a publish is taken for crashed or hung: the epoch is abandoned at once instead of
    after publish_timeout_s, and the next epoch is formed without it. This is about what a
    crashed receiver costs the learner where nothing else reports the death (`sluice run` and
    `sluice ray` do at once: sluice/launch/departed.py)."""
    ready_timeout_s: float = Field(default=10.0, gt=0)
    """When the group is rebuilt (a membership epoch), candidates that do not confirm within
    this are left out (they join again later). A member of the last epoch whose heartbeat there
    stopped for liveness_timeout_s is not waited for this long."""
    transfer: WeightTransferConfig = WeightTransferConfig()
    """ZeroMQ chunked transfer of the current version to late joiners."""

    @model_validator(mode="after")
    def _background_send_confirms_in_background(self) -> WeightSyncConfig:
        if self.send == "background" and self.confirm == "wait":
            raise ValueError(
                "weight_sync.send=background needs weight_sync.confirm=background "
                "(with confirm=wait a publish waits for the members anyway: use send=inline)"
            )
        return self
