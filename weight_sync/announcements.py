"""What the learner writes in the rendezvous store, and under which keys.

The store (a TCPStore served by learner rank 0) carries the weight-sync handshake, because a
store key cannot be missed by a slow reader and a collective cannot start before every
member has read the announcement that describes it. Only the learner writes announcements;
receivers write their epoch confirmations.

    ws/head                  next announcement sequence number (decimal)
    ws/transfer              ZeroMQ endpoint of the snapshot server (late joiners pull there)
    ws/control               control-plane endpoint receivers JOIN at (when not configured)
    ws/notices               ZeroMQ endpoint of the learner's notices: a message after each
                             write below that receivers wait for (weight_sync/notices.py)
    ws/ann/<seq>             Announcement (msgpack): epoch | weights | shutdown
    ws/ann/<seq>/sums        weights only: the announced checksum's words (xxh3-64 per
                             tensor, or wsum32 per piece), little-endian uint64 in layout
                             order, appended bucket by bucket: before, while or after the
                             bucket's data goes out (receivers wait for them before verifying)
    ws/ep<e>/ready/<svc>     a candidate of epoch e confirms it is alive (value: incarnation)
    ws/ep<e>/commit          EpochCommit: the members of epoch e, in rank order
    ws/ep<e>/abort           the learner abandoned epoch e (a collective failed): members stop
                             waiting on its collectives at once instead of timing out
    ws/ep<e>/beat/<rank>     a counter a member bumps while it waits in a collective: the
                             learner abandons the epoch when one stops (crashed or hung)
    ws/ep<e>/pg/...          the process group of epoch e (torch.distributed's own keys)

Announcements older than `KEEP_ANNOUNCEMENTS` are deleted; a receiver that fell that far
behind joins again (pulls the current version, then waits for an epoch that lists it).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from sluice.weight_sync.layout import Bucket

KEEP_ANNOUNCEMENTS = 64
HEAD_KEY = "ws/head"
TRANSFER_KEY = "ws/transfer"
CONTROL_KEY = "ws/control"
NOTICE_KEY = "ws/notices"


def ann_key(seq: int, part: Literal["sums"] | None = None) -> str:
    """`ws/ann/<seq>`, or with part="sums" the announced checksum words that go with it."""
    return f"ws/ann/{seq}" if part is None else f"ws/ann/{seq}/{part}"


EpochPart = Literal["ready", "commit", "abort", "beat", "pg"]


def epoch_key(epoch: int, part: EpochPart, member: object = None) -> str:
    """`ws/ep<e>/<part>`, or `ws/ep<e>/<part>/<member>` for a candidate's ready key (member: its
    service id) or a rank's beat counter (member: the rank). `epoch_key(e, "pg", "")` is the
    prefix under which torch.distributed keeps the epoch's process-group keys."""
    key = f"ws/ep{epoch}/{part}"
    return key if member is None else f"{key}/{member}"


class EpochAnnouncement(msgspec.Struct, tag="epoch", tag_field="kind", forbid_unknown_fields=True):
    """A new membership epoch: every candidate writes its ready key, then reads the commit."""

    epoch: int  # W: learner, increasing. R: receivers (keys of this epoch)
    candidates: list[str]  # W: learner, service ids (members + joiners). R: receivers


class WeightsAnnouncement(msgspec.Struct, tag="weights", tag_field="kind", forbid_unknown_fields=True):
    """A version follows over epoch `epoch`'s group, bucket by bucket in `buckets` order."""

    epoch: int  # W: learner. R: receivers; only members of this epoch take part
    version: int  # W: learner, policy version (optimizer steps). R: receivers, engines
    buckets: list[Bucket]  # W: learner, the layout. R: receivers allocate and unpack it
    base_version: int = -1  # W: learner. -1: every tensor follows; else a delta on top of it
    piece_bytes: int = 0  # W: learner. R: receivers (layout.piece_bounds: one broadcast per piece)
    # W: learner. R: receivers, what the sums under ws/ann/<seq>/sums are: xxh3 (one per
    # tensor, of host bytes) or wsum32 (one per piece, computed on the device; checksums.py)
    checksum: str = "xxh3"


class ShutdownAnnouncement(msgspec.Struct, tag="shutdown", tag_field="kind", forbid_unknown_fields=True):
    """The learner is done: receivers leave their loop."""


Announcement = EpochAnnouncement | WeightsAnnouncement | ShutdownAnnouncement


class EpochCommit(msgspec.Struct, forbid_unknown_fields=True):
    """Who is in epoch `epoch`: member i has group rank i + 1 (the learner is rank 0)."""

    epoch: int
    members: list[str]
    backend: str  # gloo | nccl | hccl


announcement_decoder = msgspec.msgpack.Decoder(Announcement)
commit_decoder = msgspec.msgpack.Decoder(EpochCommit)
encoder = msgspec.msgpack.Encoder()
