"""A buffer shard against docs/protocol.md, statement by statement, as a client written from the
doc alone sees it: raw msgpack frames from a DEALER (helpers.wire.RawPeer) to a real shard over
real ZeroMQ. Each test quotes the doc sentence it checks; when a test fails, either the shard or
the doc is wrong, and the doc is what clients are written from."""

from __future__ import annotations

import random
import re
import typing
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from helpers.wire import RawPeer

from sluice.config.buffer import ReplayConfig
from sluice.wire import messages

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
MAX_BATCH = 8


def doc_dtypes() -> dict[str, int]:
    """The dtype names of the doc's array table (not codec.DTYPES: this client knows only the
    doc), each with its item size in bytes read from the name (`int16`: 2; `bool` is one byte)."""
    names = re.search(r"one of `([a-z0-9 ]+)`", DOC.read_text()).group(1).split()  # type: ignore[union-attr]
    return {n: 1 if n == "bool" else int(re.search(r"\d+$", n).group()) // 8 for n in names}  # type: ignore[union-attr]


DTYPE_SIZES = doc_dtypes()
ERROR_KEYS = {"proto", "op", "id", "ok", "code", "message", "retry_after_ms"}
COMMON = {"proto", "op", "id", "ok"}


def header(op: str, id: int = 1, **keys: object) -> dict:
    return {"proto": 1, "op": op, "id": id, **keys}


def enc(value: object) -> bytes:
    return msgspec.msgpack.encode(value)


def meta(traj_id: str, group_id: str = "g", *, arrays: list | None = None, **keys: object) -> dict:
    """A TrajectoryMeta map with only the required keys (and `arrays`, `keys` if given)."""
    out = {"traj_id": traj_id, "group_id": group_id, "version": keys.pop("version", 0), **keys}
    if arrays is not None:
        out["arrays"] = arrays
    return out


def spec(name: str, dtype: str, shape: list[int]) -> dict:
    return {"name": name, "dtype": dtype, "shape": shape}


def nbytes(s: dict) -> int:
    n = DTYPE_SIZES[s["dtype"]]
    for d in s["shape"]:
        n *= d
    return n


def answer(peer: RawPeer, frames: list[bytes]) -> dict:
    """The reply header to hand-made `frames` (there must be one)."""
    reply = peer.ask(frames)
    assert reply is not None, f"no reply to {frames[:1]!r}"
    return reply


def assert_error(reply: dict, code: str, request_id: int, needle: str = "") -> None:
    assert set(reply) == ERROR_KEYS, reply
    assert (reply["op"], reply["ok"], reply["code"], reply["id"]) == ("ERROR", False, code, request_id), reply
    assert needle in reply["message"], reply


@pytest.fixture
def peer_for(shard_factory, zmq_ctx) -> Iterator:
    """`make(**buffer settings)`: a RawPeer connected to a new shard. At teardown every peer
    checks that its shard still serves ("A shard never stops serving because of a message it
    received."), then closes."""
    made: list[RawPeer] = []

    def make(**overrides) -> RawPeer:
        shard = shard_factory(**({"max_batch": MAX_BATCH} | overrides))
        made.append(RawPeer(zmq_ctx, shard.endpoint))
        return made[-1]

    yield make
    try:
        for p in made:
            assert p.request(header("PING", 999)) == header("PING", 999, ok=True)
    finally:
        for p in made:
            p.close()


@pytest.fixture
def fifo(peer_for) -> RawPeer:
    return peer_for(mode="fifo")


@pytest.fixture
def replay(peer_for) -> RawPeer:
    return peer_for(mode="replay", replay=ReplayConfig(sampling="uniform"))


# -- transport ---------------------------------------------------------------------------------


def test_a_message_without_the_delimiter_is_answered_without_it(fifo):
    """Transport: "(A shard also accepts a message without it and then answers without it.)"."""
    reply = fifo.exchange([enc(header("PING", 7))], delimiter=False)
    assert reply is not None and msgspec.msgpack.decode(reply[0]) == header("PING", 7, ok=True)


def test_pipelined_requests_are_answered_in_order_with_their_ids(fifo):
    """Transport: "A `DEALER` client may have several requests in flight; it matches replies to
    requests by `id`"; Writing a client: "replies come in the order the shard served them"."""
    for i, op in enumerate(["PING", "STATS", "PING"], start=11):
        fifo.send([enc(header(op, i))])
    got = [fifo.receive() for _ in range(3)]
    assert [msgspec.msgpack.decode(r[0])["id"] for r in got if r] == [11, 12, 13]


# -- header frame: BAD_FRAME, PROTO_VERSION, BAD_HEADER, in that order --------------------------

# First bytes that start a valid msgpack value: fixint, fixmap, fixarray, fixstr, nil, false,
# bin8, float64, uint8, int8, str8, array16, map16, negative fixint.
VALID_FIRST_BYTES = [0x11, 0x8C, 0x93, 0xA5, 0xC0, 0xC2, 0xC4, 0xCB, 0xCC, 0xD0, 0xD9, 0xDC, 0xDE, 0xF0]


@pytest.mark.parametrize("first", VALID_FIRST_BYTES)
def test_random_bytes_are_bad_frame_even_when_they_start_like_msgpack(fifo, first):
    """Errors: "`BAD_FRAME` | the header frame is not exactly one msgpack map"; Header frame:
    "Random bytes are `BAD_FRAME` even when their first byte happens to start a valid msgpack
    value." (5 random 64-byte frames per first byte, fixed seeds.)"""
    rng = random.Random(first)
    for _ in range(5):
        frame = bytes([first]) + rng.randbytes(63)
        assert_error(answer(fifo, [frame]), "BAD_FRAME", -1)


NOT_ONE_MAP = {
    "array": enc([1, 2, 3]),
    "int": enc(17),
    "str": enc("PING"),
    "nil": enc(None),
    "bin": enc(b"\x81\xa2op"),
    "bytes after the map": enc(header("PING")) + b"\x00",
    "two maps": enc(header("PING")) * 2,
    "truncated map": enc(header("PING"))[:-1],
    "not msgpack": b"\xc1\xc1",
    "nested too deeply": b"\x81\xa1x" * 100_000 + b"\x01",
    # {"proto": 1, "op": "PING", "id": 1, "x": {"x": {"x": ...}}}, 100k levels deep
    "nested too deeply inside a map": b"\x84"
    + enc(header("PING"))[1:]
    + enc("x")
    + b"\x81\xa1x" * 100_000
    + b"\x01",
}


@pytest.mark.parametrize("frame", list(NOT_ONE_MAP.values()), ids=list(NOT_ONE_MAP))
def test_a_frame_that_is_not_exactly_one_msgpack_map_is_bad_frame(fifo, frame):
    """Header frame, check 1: "a frame that is not msgpack, is truncated, has bytes after the
    value, is nested too deeply to decode, or holds another value (an array, an int, a string,
    ...) is `BAD_FRAME`"; Errors: "`id` ... `-1` when it could not be read (every
    `BAD_FRAME` ...)"."""
    assert_error(answer(fifo, [frame]), "BAD_FRAME", -1)


def test_a_message_with_no_header_frame_is_bad_frame(fifo):
    """Header frame: "... and so is a message with no header frame."."""
    reply = fifo.exchange([])
    assert reply is not None
    assert_error(msgspec.msgpack.decode(reply[0]), "BAD_FRAME", -1)


OTHER_VERSION = {
    "unknown op": header("NOPE", 5, proto=2),
    "unknown key": header("PING", 5, proto=2, surprise=True),
    "missing op": {"proto": 2, "id": 5},
    "wrong type": header("GET", 5, proto=2, max_trajs="many"),
    "v1 request": header("PING", 5, proto=2),
    "proto 0": header("NOPE", 5, proto=0),
    "negative proto": header("PING", 5, proto=-1, x=1),
    "huge proto": header("PING", 5, proto=2**40),
}


@pytest.mark.parametrize("h", list(OTHER_VERSION.values()), ids=list(OTHER_VERSION))
def test_another_version_is_proto_version_whatever_else_the_header_holds(fifo, h):
    """Header frame: "A header whose `proto` is any other integer gets `PROTO_VERSION`, whatever
    else it holds (an unknown `op`, unknown or missing keys)"; the reply echoes the `id`."""
    assert_error(fifo.request(h), "PROTO_VERSION", 5, f"proto={h['proto']}")


def test_proto_version_without_a_readable_id_answers_id_minus_one(fifo):
    """Errors: "`id` ... `-1` when it could not be read (... a `BAD_HEADER` or `PROTO_VERSION`
    whose `id` is missing or not an int)"."""
    assert_error(fifo.request({"proto": 2, "op": "PING"}), "PROTO_VERSION", -1)
    assert_error(fifo.request({"proto": 2, "op": "PING", "id": "7"}), "PROTO_VERSION", -1)


BAD_PROTO = {
    "missing": {"op": "PING", "id": 5},
    "str": header("PING", 5, proto="1"),
    "float": header("PING", 5, proto=1.0),
    "bool": header("PING", 5, proto=True),
    "nil": header("PING", 5, proto=None),
}


@pytest.mark.parametrize("h", list(BAD_PROTO.values()), ids=list(BAD_PROTO))
def test_a_missing_or_non_integer_proto_is_bad_header(fifo, h):
    """Header frame: "A `proto` that is missing or not an integer is `BAD_HEADER`."."""
    assert_error(fifo.request(h), "BAD_HEADER", 5, "proto")


SCHEMA_ERRORS = {
    "unknown op": (header("DELETE_ALL", 5), "DELETE_ALL"),
    "unknown key": (header("PING", 5, surprise=True), "surprise"),
    "missing key": (header("ACK", 5), "lease_id"),
    "missing op": ({"proto": 1, "id": 5}, "op"),
    "wrong type": (header("GET", 5, max_trajs="many"), "max_trajs"),
    "float for int": (header("GET", 5, max_trajs=2.0), "max_trajs"),
    "bool for int": (header("GET", 5, max_trajs=True), "max_trajs"),
    "bin for str": (header("ACK", 5, lease_id=b"x"), "lease_id"),
    "nested wrong type": (header("PUT", 5, trajs=[meta("t", version="0")]), "trajs[0].version"),
}


@pytest.mark.parametrize("h,needle", list(SCHEMA_ERRORS.values()), ids=list(SCHEMA_ERRORS))
def test_a_map_that_breaks_the_schema_is_bad_header_naming_the_field(fifo, h, needle):
    """Header frame: "Unknown keys are errors (`BAD_HEADER`), as are missing required keys and
    wrong types. Types are strict: an int is never read from a string, a float or a bool, a str
    never from bytes (`bin`) ... The error message names the field"."""
    assert_error(fifo.request(h), "BAD_HEADER", 5, needle)


def test_the_error_message_is_the_documented_one(fifo):
    """Header frame: "e.g. ``header: Expected `int`, got `str` - at `$.max_trajs` ``"."""
    reply = fifo.request(header("GET", 3, max_trajs="many"))
    assert reply["message"] == "header: Expected `int`, got `str` - at `$.max_trajs`"


def test_non_string_keys_and_an_unreadable_id_are_bad_header(fifo):
    """Header frame, check 3: "a key that is not a string" is `BAD_HEADER`; Errors: `id` is
    `-1` for "a `BAD_HEADER` ... whose `id` is missing or not an int" (a bool is not an int)."""
    assert_error(fifo.request({**header("PING", 5), 1: 2}), "BAD_HEADER", 5)
    assert_error(fifo.request(header("PING", True)), "BAD_HEADER", -1, "id")
    assert_error(fifo.request(header("PING", "5")), "BAD_HEADER", -1, "id")


def test_a_float_key_accepts_an_int_and_ids_span_64_bits(replay):
    """Header frame: "a float key accepts an int"; `id`: "any 64-bit integer"."""
    reply = replay.request(header("SAMPLE", 2**64 - 1, n=0, beta=1))
    assert reply["ok"] and reply["id"] == 2**64 - 1
    assert replay.request(header("PING", -(2**63)))["id"] == -(2**63)


# -- array payload frames ----------------------------------------------------------------------

SHAPES = [[], [0], [3], [2, 0], [2, 3], [1, 1, 1]]


def put_specs(peer: RawPeer, specs: list[dict], traj_id: str = "t") -> list[bytes]:
    """PUT one trajectory with these arrays (frame k filled with byte k+1); its frames."""
    frames = [bytes([k + 1]) * nbytes(s) for k, s in enumerate(specs)]
    reply = peer.request(header("PUT", 1, trajs=[meta(traj_id, arrays=specs)]), *frames)
    assert reply["ok"] and reply["accepted"] == 1, reply
    return frames


def read_back(peer: RawPeer, mode: str) -> tuple[dict, list[bytes]]:
    ask = header("GET", 2, max_trajs=1) if mode == "fifo" else header("SAMPLE", 2, n=1)
    reply = peer.exchange([enc(ask)])
    assert reply is not None
    return msgspec.msgpack.decode(reply[0]), reply[1:]


@pytest.mark.parametrize("transport", ["zmq", "shm"], indirect=True)
@pytest.mark.parametrize("mode", ["fifo", "replay"])
def test_specs_and_bytes_come_back_unchanged(peer_for, mode):
    """Array payload frames: "`[]` is a 0-d array (a scalar: `prod([]) = 1` element)"; "A shard
    stores specs as they came and sends them back unchanged: ... (`[]` comes back as `[]`,
    `[2, 0]` as `[2, 0]`), and its frame holds the same bytes." Every dtype, 0-d included."""
    peer = peer_for(mode=mode)
    specs = [spec(f"s{i}", "float32", shape) for i, shape in enumerate(SHAPES)]
    specs += [spec(f"scalar_{d}", d, []) for d in DTYPE_SIZES]
    frames = put_specs(peer, specs)
    reply, payload = read_back(peer, mode)
    assert reply["trajs"][0]["arrays"] == specs
    assert payload == frames


def test_a_0d_array_comes_back_0d_after_a_restart(shard_factory, zmq_ctx, tmp_path):
    """Array payload frames: "`[]` comes back as `[]`"; durability: "A restarted shard serves
    exactly: everything PUT and not ACKed"."""
    shard = shard_factory(log_dir=tmp_path)
    specs = [spec("x", "float64", []), spec("y", "int32", [2, 0])]
    with RawPeer(zmq_ctx, shard.endpoint) as peer:
        frames = put_specs(peer, specs)
    shard.restart()
    with RawPeer(zmq_ctx, shard.endpoint) as peer:
        reply, payload = read_back(peer, "fifo")
    assert reply["trajs"][0]["arrays"] == specs and payload == frames


def test_payload_count_and_length_errors_name_the_frame(fifo):
    """Array payload frames: "A frame count or length that disagrees with the specs gets
    `BAD_PAYLOAD` naming the frame (1-based among payload frames), e.g. `header announces 6
    array frames, message carries 5` or `frame 3 (trajs[0].arrays[2] 'behaviour_logprobs'): 16
    bytes, float32[5] needs 20`."."""
    specs = [spec("a", "int32", [1]), spec("b", "int32", [1]), spec("behaviour_logprobs", "float32", [5])]
    put = header("PUT", 4, trajs=[meta("t", arrays=specs)])
    reply = fifo.request(put, b"\x00" * 4, b"\x00" * 4, b"\x00" * 16)
    assert_error(
        reply,
        "BAD_PAYLOAD",
        4,
        "frame 3 (trajs[0].arrays[2] 'behaviour_logprobs'): 16 bytes, float32[5] needs 20",
    )
    reply = fifo.request(put, b"\x00" * 4, b"\x00" * 4)
    assert_error(reply, "BAD_PAYLOAD", 4, "header announces 3 array frames, message carries 2")


def test_requests_other_than_put_take_no_payload(fifo):
    """Array payload frames: "Requests other than PUT take no payload frames (`BAD_PAYLOAD`)."."""
    assert_error(fifo.request(header("PING", 6), b"extra"), "BAD_PAYLOAD", 6)


@pytest.mark.parametrize(
    "bad,needle",
    [(spec("x", "complex128", [1]), "trajs[0].arrays[0].dtype"), (spec("x", "int32", [-4]), "negative")],
)
def test_unknown_dtypes_and_negative_dimensions_are_bad_header(fifo, bad, needle):
    """ArraySpec: "another name is `BAD_HEADER` (`trajs[i].arrays[j].dtype=...`)"; `shape`:
    "each `>= 0` (a negative one is `BAD_HEADER`)"."""
    assert_error(
        fifo.request(header("PUT", 8, trajs=[meta("t", arrays=[bad])]), b"\x00" * 16), "BAD_HEADER", 8, needle
    )


# -- operations: request defaults, reply keys --------------------------------------------------


def put_group(peer: RawPeer, group_id: str, size: int = 1, version: int = 0, id: int = 1) -> dict:
    """PUT a group of `size` trajectories without arrays; the reply."""
    trajs = [meta(f"{group_id}/{j}", group_id, version=version, group_size=size) for j in range(size)]
    return peer.request(header("PUT", id, trajs=trajs))


def test_put_reply_keys_and_counts(fifo):
    """PUT: "Reply: `{"proto":1,"op":"PUT","id":N,"ok":true,"accepted":A,"duplicates":D,
    "next_region":null}`"; "`accepted + duplicates` = `len(trajs)`"; "A `traj_id` repeated
    within one PUT is stored once; the others count as `duplicates`."; "`[]` stores nothing and
    answers `accepted` 0"."""
    reply = put_group(fifo, "a", size=2, id=3)
    assert reply == header("PUT", 3, ok=True, accepted=2, duplicates=0, next_region=None)
    assert put_group(fifo, "a", size=2, id=4)["duplicates"] == 2  # idempotent by traj_id
    twice = [meta("b/0", "b"), meta("b/0", "b")]
    assert fifo.request(header("PUT", 5, trajs=twice))["accepted"] == 1
    assert fifo.request(header("PUT", 6, trajs=[]))["accepted"] == 0


def test_put_limits(peer_for):
    """PUT: "at most `buffer.max_batch` (more: `TOO_LARGE`)"; "a group with fewer new members
    than `group_size` is `BAD_HEADER`"; "`fifo`: if the shard would exceed `capacity`
    trajectories ... it stores nothing and answers `FULL` with `retry_after_ms`"."""
    peer = peer_for(capacity=2, retry_after_ms=25)
    many = [meta(f"t{i}", f"g{i}") for i in range(MAX_BATCH + 1)]
    assert_error(peer.request(header("PUT", 2, trajs=many)), "TOO_LARGE", 2, "max_batch")
    incomplete = [meta("h/0", "h", group_size=2)]
    assert_error(peer.request(header("PUT", 3, trajs=incomplete)), "BAD_HEADER", 3, "group_size")
    assert put_group(peer, "a", size=2)["accepted"] == 2
    full = put_group(peer, "b", id=4)
    assert_error(full, "FULL", 4)
    assert full["retry_after_ms"] == 25


def test_get_defaults_and_reply_keys(fifo):
    """GET: "every one but `max_trajs` may be left out", defaults `min_version` 0, `policy_id`
    "default", `wait_ms` 0 ("`0` answers at once"); "Reply: `{"proto":1,"op":"GET","id":N,
    "ok":true,"lease_id":"...","trajs":[...],"dropped_stale":K,"refs":[],"acked":0}`";
    "`lease_id` ... `""` when nothing was leased"."""
    empty = fifo.request(header("GET", 2, max_trajs=4))
    assert empty == header("GET", 2, ok=True, lease_id="", trajs=[], dropped_stale=0, refs=[], acked=0)
    put_group(fifo, "a", size=2)
    got = fifo.request(header("GET", 3, max_trajs=1))  # a whole group, even above max_trajs
    assert set(got) == COMMON | {"lease_id", "trajs", "dropped_stale", "refs", "acked"}
    assert got["lease_id"] and [t["traj_id"] for t in got["trajs"]] == ["a/0", "a/1"]
    assert got["trajs"][0] == meta(
        "a/0", "a", group_size=2, policy_id="default", reward=0.0, arrays=[], info={}
    )


def test_get_filters_by_version_and_policy(fifo):
    """GET: "Groups with `version < min_version` reaching the front are **dropped** (counted in
    `dropped_stale`), never leased"; `policy_id`: "which policy's queue"."""
    put_group(fifo, "old", size=2, version=1)
    put_group(fifo, "new", version=5)
    assert fifo.request(header("GET", 2, max_trajs=4, policy_id="other"))["trajs"] == []
    got = fifo.request(header("GET", 3, max_trajs=4, min_version=3))
    assert got["dropped_stale"] == 2 and [t["group_id"] for t in got["trajs"]] == ["new"]


@pytest.mark.parametrize(
    "keys,code",
    [
        ({"max_trajs": 0}, "BAD_HEADER"),
        ({"max_trajs": MAX_BATCH + 1}, "TOO_LARGE"),
        ({"max_trajs": 1, "wait_ms": -1}, "BAD_HEADER"),
        ({"max_trajs": 1, "ack": ["x"] * (MAX_BATCH + 1)}, "TOO_LARGE"),
    ],
)
def test_get_ranges(fifo, keys, code):
    """GET: `max_trajs` "in `[1, buffer.max_batch]`: below 1 is `BAD_HEADER`, above `max_batch`
    is `TOO_LARGE`"; `wait_ms` "negative is `BAD_HEADER`"; `ack` "at most `max_batch` (more:
    `TOO_LARGE`)"."""
    assert_error(fifo.request(header("GET", 4, **keys)), code, 4)


def test_get_with_ack_settles_first(fifo):
    """GET: "With `"ack":[L1, L2, ...]` the shard ACKs those leases first ... and the reply says
    how many trajectories that deleted in `acked`"; "One that cannot be ACKed fails the whole
    request with `UNKNOWN_LEASE` before anything is leased"."""
    put_group(fifo, "a", size=2)
    put_group(fifo, "b", id=2)
    first = fifo.request(header("GET", 3, max_trajs=2))
    assert_error(fifo.request(header("GET", 4, max_trajs=2, ack=["nope"])), "UNKNOWN_LEASE", 4, "nope")
    second = fifo.request(header("GET", 5, max_trajs=2, ack=[first["lease_id"]]))
    assert second["acked"] == 2 and [t["group_id"] for t in second["trajs"]] == ["b"]


def test_a_holders_new_incarnation_takes_over_and_the_old_one_is_superseded(fifo):
    """GET: "When a shard sees a holder's GET with another `incarnation` than the last one it saw
    for that holder, ... the shard returns every lease the holder's earlier incarnations hold to
    the front of their queues"; "Those leases can no longer be ACKed (`UNKNOWN_LEASE`)"; "A GET
    from a replaced incarnation ... is refused with `SUPERSEDED` and changes nothing"."""
    put_group(fifo, "a", size=2)
    put_group(fifo, "b", id=2)
    old = fifo.request(header("GET", 3, max_trajs=2, holder="learner/p", incarnation="1"))
    anon = fifo.request(header("GET", 4, max_trajs=2))
    assert [t["traj_id"] for t in old["trajs"]] == ["a/0", "a/1"] and anon["trajs"][0]["group_id"] == "b"
    new = fifo.request(header("GET", 5, max_trajs=2, holder="learner/p", incarnation="2"))
    assert [t["traj_id"] for t in new["trajs"]] == ["a/0", "a/1"]
    assert_error(fifo.request(header("ACK", 6, lease_id=old["lease_id"])), "UNKNOWN_LEASE", 6)
    assert_error(
        fifo.request(header("GET", 7, max_trajs=2, holder="learner/p", incarnation="1")), "SUPERSEDED", 7
    )
    stats = fifo.request(header("STATS", 8))["stats"]
    assert stats["taken_over"] == 2 and stats["leases"] == 2  # the new incarnation's and anon's


def test_ack_and_nack_replies(fifo):
    """ACK / NACK: "Replies: `{"proto":1,"op":"ACK","id":N,"ok":true,"count":C,"replayed":false}`
    and `{"proto":1,"op":"NACK","id":N,"ok":true,"count":C}`"; "An ACK of a lease that was ACKed
    before ... answers `ok` with `"replayed":true`"; "A lease that ... was NACKed ... is
    `UNKNOWN_LEASE`", "and so is a NACK of a lease that is not held (also one ACKed before)"."""
    put_group(fifo, "a", size=2)
    lease = fifo.request(header("GET", 2, max_trajs=2))["lease_id"]
    assert fifo.request(header("NACK", 3, lease_id=lease)) == header("NACK", 3, ok=True, count=2)
    assert_error(fifo.request(header("ACK", 4, lease_id=lease)), "UNKNOWN_LEASE", 4, lease)
    again = fifo.request(header("GET", 5, max_trajs=2))
    assert [t["traj_id"] for t in again["trajs"]] == ["a/0", "a/1"]  # back at the front, in order
    ack = header("ACK", 6, lease_id=again["lease_id"])
    assert fifo.request(ack) == header("ACK", 6, ok=True, count=2, replayed=False)
    assert fifo.request(ack) == header("ACK", 6, ok=True, count=2, replayed=True)
    assert_error(fifo.request(header("NACK", 7, lease_id=again["lease_id"])), "UNKNOWN_LEASE", 7)


def test_cancel_answers_the_parked_get_first(fifo):
    """CANCEL: "If that GET is still parked, it is answered now (an empty GET reply with id `T`),
    then the CANCEL reply `{"proto":1,"op":"CANCEL","id":N,"ok":true,"cancelled":true}`
    follows. If it was answered already ..., or no such GET of this connection is parked,
    `cancelled` is `false`."."""
    fifo.send([enc(header("GET", 40, max_trajs=1, wait_ms=60_000))])  # parked: nothing to lease
    fifo.send([enc(header("CANCEL", 41, target=40))])
    replies = [fifo.receive() for _ in range(2)]
    got = [msgspec.msgpack.decode(r[0]) for r in replies if r]
    assert got == [
        header("GET", 40, ok=True, lease_id="", trajs=[], dropped_stale=0, refs=[], acked=0),
        header("CANCEL", 41, ok=True, cancelled=True),
    ]
    assert fifo.request(header("CANCEL", 42, target=40)) == header("CANCEL", 42, ok=True, cancelled=False)


def test_sample_defaults_and_reply_keys(replay):
    """SAMPLE: "every one but `n` may be left out"; "Reply: `{"proto":1,"op":"SAMPLE","id":N,
    "ok":true,"items":[SampledItem...],"trajs":[TrajectoryMeta...],"count":C,
    "total_priority":P,"dropped_stale":S,"refs":[]}`"; `total_priority` "with `uniform`
    sampling, `count`"; "`n = 0` only reports `count` and `total_priority`"."""
    put_group(replay, "a", size=2)
    put_group(replay, "b", id=2)
    only = replay.request(header("SAMPLE", 3, n=0))
    assert only == header(
        "SAMPLE", 3, ok=True, items=[], trajs=[], count=2, total_priority=2.0, dropped_stale=0, refs=[]
    )
    drawn = replay.request(header("SAMPLE", 4, n=3, seed=7))
    assert set(drawn) == set(only) and len(drawn["items"]) == 3
    assert all(set(item) == {"key", "size", "prob", "weight"} for item in drawn["items"])
    assert sum(item["size"] for item in drawn["items"]) == len(drawn["trajs"])
    assert replay.request(header("SAMPLE", 4, n=3, seed=7)) == drawn  # `seed`: reproducible


@pytest.mark.parametrize(
    "keys,code",
    [({"n": -1}, "BAD_HEADER"), ({"n": MAX_BATCH + 1}, "TOO_LARGE"), ({"n": 1, "beta": -1.0}, "BAD_HEADER")],
)
def test_sample_ranges(replay, keys, code):
    """SAMPLE: `n` "in `[0, buffer.max_batch]`: negative is `BAD_HEADER`, above `max_batch` is
    `TOO_LARGE`"; `beta` "finite and `>= 0` (else `BAD_HEADER`)"."""
    assert_error(replay.request(header("SAMPLE", 5, **keys)), code, 5)


def test_sample_drops_stale_groups_first(replay):
    """SAMPLE: "First drops (and counts) every stored group of the policy with `version <
    min_version`"; `dropped_stale`: "trajectories this SAMPLE dropped"."""
    put_group(replay, "old", size=2, version=1)
    put_group(replay, "new", version=4, id=2)
    reply = replay.request(header("SAMPLE", 3, n=2, min_version=2))
    assert reply["dropped_stale"] == 2 and reply["count"] == 1
    assert {t["group_id"] for t in reply["trajs"]} == {"new"}


def test_priority_reply_counts_distinct_keys(replay):
    """PRIORITY: "A key repeated takes its last priority. Reply: `{"proto":1,"op":"PRIORITY",
    "id":N,"ok":true,"updated":U,"unknown":X}`": `updated` "distinct stored keys whose priority
    was set", `unknown` "distinct keys of groups no longer stored"."""
    put_group(replay, "a")
    key = replay.request(header("SAMPLE", 2, n=1))["items"][0]["key"]
    reply = replay.request(header("PRIORITY", 3, keys=[key, key, 10**6], priorities=[1.0, 2.0, 3.0]))
    assert reply == header("PRIORITY", 3, ok=True, updated=1, unknown=1)


@pytest.mark.parametrize(
    "keys,code,needle",
    [
        ({"keys": [0, 1], "priorities": [1.0]}, "BAD_HEADER", "priorities"),
        ({"keys": [0], "priorities": [-1.0]}, "BAD_HEADER", "priorities[0]"),
        (
            {"keys": list(range(MAX_BATCH + 1)), "priorities": [1.0] * (MAX_BATCH + 1)},
            "TOO_LARGE",
            "max_batch",
        ),
    ],
)
def test_priority_ranges(replay, keys, code, needle):
    """PRIORITY: `keys` "at most `max_batch` (more: `TOO_LARGE`)"; `priorities` "one per key
    (another length is `BAD_HEADER`), each finite and `>= 0` (else `BAD_HEADER` naming the
    entry)"."""
    assert_error(replay.request(header("PRIORITY", 6, **keys)), code, 6, needle)


@pytest.mark.parametrize(
    "mode,op,keys",
    [
        ("replay", "GET", {"max_trajs": 1}),
        ("replay", "ACK", {"lease_id": "x"}),
        ("replay", "NACK", {"lease_id": "x"}),
        ("fifo", "SAMPLE", {"n": 1}),
        ("fifo", "PRIORITY", {"keys": [], "priorities": []}),
    ],
)
def test_an_op_of_the_other_mode_is_wrong_mode(peer_for, mode, op, keys):
    """Operations: "an op of the other mode is answered `WRONG_MODE`"."""
    peer = peer_for(mode=mode)
    assert_error(peer.request(header(op, 9, **keys)), "WRONG_MODE", 9, op)


@pytest.mark.parametrize("mode", ["fifo", "replay"])
def test_stats_ping_hello_reply_keys(peer_for, mode):
    """STATS: "answers `{"proto":1,"op":"STATS","id":N,"ok":true,"stats":{...},"versions":
    {"3":128,...}}`", with the keys "Every shard reports"; PING: "answers `{"proto":1,"op":"PING",
    "id":N,"ok":true}`"; HELLO: its reply keys, `host_id` defaulting to `""`."""
    peer = peer_for(mode=mode)
    put_group(peer, "a", size=2, version=3)
    stats = peer.request(header("STATS", 2))
    assert set(stats) == COMMON | {"stats", "versions"} and stats["versions"] == {"3": 2}
    every = {"shard", "capacity", "capacity_bytes", "held", "held_bytes", "policies", "dedupe_ids", "put"}
    every |= {"duplicates", "dropped_stale", "refused_full", "parked_gets", "same_host", "refs_served"}
    per_mode = {"fifo": {"queued", "queued_bytes", "leased", "leases", "delivered", "acked", "redelivered"}}
    per_mode["replay"] = {"stored", "stored_groups", "evicted", "sampled", "priority_updates"}
    assert every | per_mode[mode] <= set(stats["stats"])
    assert all(type(v) is int for v in stats["stats"].values())
    assert peer.request(header("PING", 3)) == header("PING", 3, ok=True)
    hello = peer.request(header("HELLO", 4))
    assert set(hello) == COMMON | {
        "host_id",
        "shared_dir",
        "token_file",
        "min_put_bytes",
        "reserve_timeout_ms",
    }


def test_reserve_needs_the_token(fifo):
    """RESERVE: "Errors: `NOT_SAME_HOST` (token)"; "a shard serves a `token` that is not its own
    as if there were none (GET, SAMPLE)"."""
    assert_error(fifo.request(header("RESERVE", 3, nbytes=64, token="guess")), "NOT_SAME_HOST", 3, "token")
    assert fifo.request(header("GET", 4, max_trajs=1, token="guess"))["refs"] == []


# -- the doc lists every key ----------------------------------------------------------------------


def doc_sections() -> dict[str, str]:
    """docs/protocol.md split at its `##` and `###` headings: heading -> text under it."""
    parts = re.split(r"^#{2,3} (.+)$", DOC.read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def section_of(op: str, sections: dict[str, str]) -> str:
    found = [text for heading, text in sections.items() if re.search(rf"\b{op}\b", heading.split(":")[0])]
    assert len(found) == 1, f"docs/protocol.md: no single section for {op}"
    return found[0]


def documented(name: str, text: str) -> bool:
    return f"`{name}`" in text or f'"{name}"' in text


def test_the_doc_lists_every_request_and_reply_key():
    """Header frame: "each op's section below lists every key it takes, with its type and its
    default"; "A reply carries every key listed for its op ... and no other": every field of
    every request and reply schema (sluice/wire/messages.py) is named in its op's section (the
    shared ones under "Header frame", ErrorReply's under "Errors")."""
    sections = doc_sections()
    structs = [*typing.get_args(messages.Request), *typing.get_args(messages.Reply)]
    shared = {"proto", "id", "ok"}  # every reply's and request's: under "Header frame"
    missing = []
    for cls in structs:
        op = cls.__struct_config__.tag
        text = sections["Errors"] if op == "ERROR" else section_of(str(op), sections)
        missing += [
            f"{op}.{f.name}"
            for f in msgspec.structs.fields(cls)
            if f.name not in shared and not documented(f.name, text)
        ]
    nested = {"Header frame": ["proto", "op", "id", "ok"], "Array payload frames": ["name", "dtype", "shape"]}
    nested["PUT: store trajectories"] = [f.name for f in msgspec.structs.fields(messages.Region)]
    nested["SAMPLE: draw from a replay shard"] = [
        f.name for f in msgspec.structs.fields(messages.SampledItem)
    ]
    nested["Trajectory metadata (TrajectoryMeta)"] = [
        f.name for f in msgspec.structs.fields(messages.TrajectoryMeta)
    ]
    for heading, names in nested.items():
        missing += [f"{heading}: {n}" for n in names if not documented(n, sections[heading])]
    assert not missing, f"docs/protocol.md does not name {missing}"
