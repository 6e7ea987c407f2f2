"""The client's half of the same-host data plane: PUT messages written straight into regions of
a shard's segment files (RESERVE, or the spare region the last PUT brought; pwritev; a PUT of
the headers naming the region and its checksum), and GET/SAMPLE replies read as views of those
files. Whatever fails here (refused token, unwritable file, refused region) falls back to
ZeroMQ frames, so it only ever changes how the bytes travel. Why and how the shard side works:
docs/architecture.md, Buffer (same-host data plane); the per-shard peer is `same_host.py`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from sluice.buffer.link import Call, Lost, NotSent, ShardLink, wait_all
from sluice.buffer.placement import OutGroup
from sluice.buffer.same_host import RegionPayload, SameHostPeer
from sluice.rpc import RpcError
from sluice.trajectory import Trajectory, from_wire_batch
from sluice.wire.messages import PROTO_VERSION, PutRequest, ReserveReply, ReserveRequest

log = logging.getLogger(__name__)

Sent = tuple[list[OutGroup], Call]  # a PUT message's groups and its request


class SameHostPuts:
    """PUT messages through shared memory, for one client's links (not thread-safe)."""

    def __init__(
        self,
        links: Sequence[ShardLink],
        timeout_s: float,
        min_put_bytes: int | None,
        send_frames: Callable[[list[OutGroup]], Call],
    ) -> None:
        self.links = links
        self.timeout_s = timeout_s
        self.min_put_bytes = min_put_bytes  # None: each shard's advice
        self.send_frames = send_frames  # the ordinary PUT, to fall back on
        self.shared_put_bytes = 0  # payload bytes PUT through shared memory
        self.reserve_requests = 0  # RESERVE round trips (most same-host PUTs need none)

    def wants(self, link: ShardLink, groups: list[OutGroup]) -> bool:
        """Whether this message goes through shared memory: its shard is on this host, it was
        not refused before, and it is large enough to be worth it."""
        peer = link.peer
        if peer is None or any(g.frames_only for g in groups):
            return False
        least = self.min_put_bytes if self.min_put_bytes is not None else peer.min_put_bytes
        return sum(g.nbytes for g in groups) >= max(1, least)

    def send(self, messages: list[list[OutGroup]]) -> list[Sent]:
        """Send messages `wants` took. Each goes at once into the region its shard reserved
        with our last PUT (a spare), or after a RESERVE (sent for all such messages at once,
        their checksums computed while the replies come)."""
        sent: list[Sent] = []
        reserving, ready, releases = [], [], []
        now = time.monotonic()
        for groups in messages:
            link = self.links[groups[0].shard]
            peer = link.peer
            assert peer is not None  # (`wants` took it)
            payload = RegionPayload([w for g in groups for w in g.wire])
            peer.note_put_bytes(payload.nbytes)
            spare, release = peer.spare_for(payload.nbytes, now)
            releases += [self.release_call(link, peer, region) for region in release]
            if spare is not None:
                ready.append((groups, peer, spare, payload))
            else:
                reserving.append((groups, self._reserve(link, peer, payload.nbytes), payload))
        for groups, peer, spare, payload in ready:
            sent.append(
                (groups, self._put_region(groups, peer, spare.region, spare.segment, spare.offset, payload))
            )
        for _, _, payload in reserving:
            payload.checksum  # noqa: B018 - (computed while the RESERVE replies are on their way)
        if reserving or releases:
            wait_all([call for _, call, _ in reserving] + releases, self.links)
            sent += [
                (groups, self._after_reserve(groups, call, payload)) for groups, call, payload in reserving
            ]
        return sent

    def keep_next_region(self, call: Call) -> None:
        """Keep the region a stored PUT's shard reserved for our next PUT (if the peer it was
        reserved for is still the link's: a new connection means a new shard process)."""
        region, peer = getattr(call.reply, "next_region", None), call.peer
        if region is not None and peer is not None and call.link is not None and peer is call.link.peer:
            peer.keep_spare(region, time.monotonic())

    def release_call(
        self, link: ShardLink, peer: SameHostPeer, region: int, timeout_s: float | None = None
    ) -> Call:
        """Give back a region the shard reserved for us that we will not use (its outcome does
        not matter: an unreleased region expires; see `release_spares`)."""
        call = Call(
            ReserveRequest(
                proto=PROTO_VERSION, id=link.next_id(), nbytes=0, token=peer.token, release=region
            ),
            timeout_s=timeout_s or self.timeout_s,
        )
        link.send(call)
        return call

    def release_spares(self) -> None:
        """Give back the regions shards reserved for PUTs that will not come (best effort: an
        unreleased one expires after reserve_timeout_s, and its segment file is then deleted
        rather than reused)."""
        calls = []
        for link in self.links:
            peer = link.peer
            if peer is not None:
                calls += [self.release_call(link, peer, r, timeout_s=0.5) for r in peer.take_spares()]
        if calls:
            wait_all(calls, self.links)

    def _reserve(self, link: ShardLink, peer: SameHostPeer, nbytes: int) -> Call:
        call = Call(
            ReserveRequest(proto=PROTO_VERSION, id=link.next_id(), nbytes=nbytes, token=peer.token),
            timeout_s=self.timeout_s,
            peer=peer,
        )
        link.send(call)
        self.reserve_requests += 1
        return call

    def _after_reserve(self, groups: list[OutGroup], reserve: Call, payload: RegionPayload) -> Call:
        """A reservation that failed is returned as the outcome (FULL: wait; lost or not sent:
        the PUT never left, retry), or the message goes as frames (the shard refused shared
        memory); else write and PUT."""
        link = self.links[groups[0].shard]
        if isinstance(reserve.error, (NotSent, Lost)):
            reserve.error = NotSent(f"{link.name}: RESERVE failed ({reserve.error}); the PUT was not sent")
            return reserve
        if isinstance(reserve.error, RpcError):
            if reserve.error.code == "FULL":
                return reserve
            if reserve.error.code == "NOT_SAME_HOST":
                link.peer_refused()
            return self.send_frames(groups)
        region: ReserveReply = reserve.reply
        assert reserve.peer is not None  # (`_reserve` names it)
        return self._put_region(groups, reserve.peer, region.region, region.segment, region.offset, payload)

    def _put_region(
        self,
        groups: list[OutGroup],
        peer: SameHostPeer,
        region: int,
        segment: int,
        offset: int,
        payload: RegionPayload,
    ) -> Call:
        """Write the arrays into the region and PUT the headers naming it (asking for the next
        region with it), or, if the file cannot be written, PUT them as frames."""
        link = self.links[groups[0].shard]
        try:
            peer.write(segment, offset, payload)
        except OSError as e:  # (the reservation expires on the shard)
            log.warning("%s: cannot write its shared segment (%s): using ZeroMQ", link.name, e)
            link.peer_refused()
            return self.send_frames(groups)
        header = PutRequest(
            proto=PROTO_VERSION,
            id=link.next_id(),
            trajs=[m for g in groups for m in g.metas],
            region=region,
            region_checksum=payload.checksum,
            reserve_next=peer.next_put_bytes(),
        )
        call = Call(header, (), self.timeout_s, peer=peer)
        link.send(call)
        self.shared_put_bytes += sum(g.nbytes for g in groups)
        return call


def refused_region(call: Call) -> bool:
    """A same-host PUT refused for its region (not written as it says, expired, used)."""
    return (
        isinstance(call.header, PutRequest)
        and call.header.region is not None
        and isinstance(call.error, RpcError)
        and call.error.code == "BAD_PAYLOAD"
    )


def reply_trajectories(call: Call) -> tuple[list[Trajectory], int]:
    """The trajectories of a GET or SAMPLE reply, and how many are views of the shard's files
    (where it sent references; the rest are views of the payload frames)."""
    reply = call.reply
    token = getattr(call.header, "token", "")
    if token and reply.refs and call.peer is not None:
        return call.peer.trajectories(reply.trajs, reply.refs, call.frames), sum(
            r.segment >= 0 for r in reply.refs
        )
    if token and reply.trajs and call.link is not None:
        call.link.peer_refused()  # the shard did not take the token: it restarted, or moved
    return from_wire_batch(reply.trajs, call.frames), 0
