"""Fuzzed frames: random bytes, truncated msgpack, wrong types, huge lengths, oversized messages.
Every one gets an error reply naming the problem (or, above ZMQ_MAXMSGSIZE, a closed
connection), and the shard keeps serving."""

from __future__ import annotations

import io

import msgspec
import pytest
from helpers.wire import RawPeer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.buffer.log_records import CorruptRecord, read_record
from sluice.config.buffer import ReplayConfig
from sluice.wire.messages import ErrorCode

CODES = set(ErrorCode.__args__)
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

META = {
    "traj_id": "t",
    "group_id": "g",
    "version": 0,
    "arrays": [{"name": "x", "dtype": "int32", "shape": [4]}],
}
VALID = {
    "PUT": ({"proto": 1, "op": "PUT", "id": 1, "trajs": [META]}, [b"\x00" * 16]),
    "GET": (
        {"proto": 1, "op": "GET", "id": 1, "max_trajs": 4, "min_version": 0, "policy_id": "p", "wait_ms": 0},
        [],
    ),
    "ACK": ({"proto": 1, "op": "ACK", "id": 1, "lease_id": "x"}, []),
    "SAMPLE": ({"proto": 1, "op": "SAMPLE", "id": 1, "n": 2, "beta": 0.5, "policy_id": "p"}, []),
    "PRIORITY": ({"proto": 1, "op": "PRIORITY", "id": 1, "keys": [0], "priorities": [1.0]}, []),
    "CANCEL": ({"proto": 1, "op": "CANCEL", "id": 1, "target": 3}, []),
    "HELLO": ({"proto": 1, "op": "HELLO", "id": 1, "host_id": "h"}, []),
    "RESERVE": ({"proto": 1, "op": "RESERVE", "id": 1, "nbytes": 4096, "token": "t"}, []),
    "PUT_REGION": (
        {"proto": 1, "op": "PUT", "id": 1, "trajs": [META], "region": 7, "region_checksum": 0},
        [],
    ),
    "GET_REFS": ({"proto": 1, "op": "GET", "id": 1, "max_trajs": 4, "token": "t"}, []),
}
# For each field, values of a type it never accepts (msgspec is strict: no int<->str, no
# float->int, no bool->int coercion).
INTS = st.integers(min_value=-(2**63), max_value=2**64 - 1)  # what msgpack can carry
NOT_INT = st.one_of(st.text(max_size=8), st.floats(allow_nan=False), st.none(), st.lists(INTS, max_size=3))
NOT_STR = st.one_of(
    INTS, st.floats(allow_nan=False), st.none(), st.booleans(), st.lists(st.text(), max_size=2)
)
NOT_LIST = st.one_of(INTS, st.text(max_size=8), st.none(), st.dictionaries(st.text(max_size=3), INTS))
NOT_MAP = st.one_of(INTS, st.text(max_size=8), st.none(), st.lists(INTS, max_size=3))
NOT_FLOAT = st.one_of(st.text(max_size=8), st.none(), st.lists(st.floats(), max_size=2))
WRONG = {
    "id": NOT_INT,
    "max_trajs": NOT_INT,
    "min_version": NOT_INT,
    "wait_ms": NOT_INT,
    "n": NOT_INT,
    "target": NOT_INT,
    "policy_id": NOT_STR,
    "lease_id": NOT_STR,
    "trajs": NOT_LIST,
    "keys": NOT_LIST,
    "priorities": NOT_LIST,
    "beta": NOT_FLOAT,
    "host_id": NOT_STR,
    "token": NOT_STR,
    "nbytes": NOT_INT,
    "region": st.one_of(st.text(max_size=8), st.floats(allow_nan=False), st.lists(INTS, max_size=3)),
    "region_checksum": NOT_INT,
}
META_WRONG = {
    "traj_id": NOT_STR,
    "group_id": NOT_STR,
    "version": NOT_INT,
    "group_size": NOT_INT,
    "reward": NOT_FLOAT,
    "arrays": NOT_LIST,
    "info": NOT_MAP,
}


class Peer(RawPeer):
    def assert_serving(self) -> None:
        pong = self.request({"proto": 1, "op": "PING", "id": 99})
        assert pong == {"proto": 1, "op": "PING", "id": 99, "ok": True}


@pytest.fixture(params=["fifo", "replay"])
def peer(request, shard_factory, zmq_ctx):
    shard = shard_factory(mode=request.param, replay=ReplayConfig(sampling="prioritized"), max_batch=64)
    p = Peer(zmq_ctx, shard.endpoint)
    yield p
    p.assert_serving()
    p.close()


def assert_error(reply: dict | None) -> None:
    assert reply is not None, "no reply"
    assert reply["ok"] is False and reply["op"] == "ERROR", reply
    assert reply["code"] in CODES and reply["message"], reply


def test_random_bytes_get_error_replies(peer):
    @FUZZ
    @given(st.lists(st.binary(max_size=300), min_size=1, max_size=5))
    def check(frames):
        assert_error(peer.ask(frames))

    check()


def test_truncated_msgpack_gets_error_replies(peer):
    @FUZZ
    @given(st.sampled_from(sorted(VALID)), st.data())
    def check(op, data):
        header, payload = VALID[op]
        raw = msgspec.msgpack.encode(header)
        cut = data.draw(st.integers(min_value=0, max_value=len(raw) - 1))
        reply = peer.ask([raw[:cut], *payload])
        assert_error(reply)
        assert reply["code"] == "BAD_FRAME", reply

    check()


def test_wrong_types_get_bad_header_naming_the_field(peer):
    fields = [(op, f) for op, (h, _) in VALID.items() for f in h if f in WRONG]

    @FUZZ
    @given(st.sampled_from(fields), st.data())
    def check(op_field, data):
        op, name = op_field
        header, payload = VALID[op]
        bad = dict(header, **{name: data.draw(WRONG[name])})
        reply = peer.ask([msgspec.msgpack.encode(bad), *payload])
        assert_error(reply)
        assert reply["code"] == "BAD_HEADER" and name in reply["message"], reply

    check()


def test_wrong_types_inside_a_trajectory_name_the_field(peer):
    @FUZZ
    @given(st.sampled_from(sorted(META_WRONG)), st.data())
    def check(name, data):
        header, payload = VALID["PUT"]
        meta = dict(META, **{name: data.draw(META_WRONG[name])})
        reply = peer.ask([msgspec.msgpack.encode(dict(header, trajs=[meta])), *payload])
        assert_error(reply)
        assert reply["code"] == "BAD_HEADER" and f"trajs[0].{name}" in reply["message"], reply

    check()


def test_structurally_random_requests_never_break_the_shard(peer):
    """Any op with any fields of any type: a reply with `ok`, an error code when not ok."""
    values = st.recursive(
        st.one_of(st.none(), st.booleans(), INTS, st.floats(), st.text(max_size=10), st.binary(max_size=10)),
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
        ),
        max_leaves=12,
    )
    keys = st.sampled_from(
        ["proto", "op", "id", "trajs", "max_trajs", "n", "keys", "priorities", "lease_id", "x"]
        + ["nbytes", "token", "region", "region_checksum", "host_id"]
    )

    @FUZZ
    @given(
        st.sampled_from([*(h["op"] for h, _ in VALID.values()), "STATS", "PING", "NACK", "NOPE"]),
        st.dictionaries(keys, values, max_size=5),
        st.lists(st.binary(max_size=64), max_size=3),
    )
    def check(op, fields, payload):
        header = {"proto": 1, "op": op, "id": 5, **fields}
        reply = peer.ask([msgspec.msgpack.encode(header), *payload])
        assert reply is not None and "ok" in reply
        if not reply["ok"]:
            assert_error(reply)

    check()


@pytest.mark.parametrize(
    "spec_shape,frame,code,needle",
    [
        ([2**40], b"\x00" * 16, "BAD_PAYLOAD", "frame 1"),
        ([2**32, 2**32], b"\x00" * 16, "BAD_PAYLOAD", "frame 1"),
        ([2**63 - 1], b"", "BAD_PAYLOAD", "frame 1"),
        ([-4], b"", "BAD_HEADER", "negative"),
    ],
)
def test_huge_or_negative_lengths(peer, spec_shape, frame, code, needle):
    meta = dict(META, arrays=[{"name": "x", "dtype": "int32", "shape": spec_shape}])
    reply = peer.ask([msgspec.msgpack.encode({"proto": 1, "op": "PUT", "id": 3, "trajs": [meta]}), frame])
    assert_error(reply)
    assert reply["code"] == code and needle in reply["message"] and reply["id"] == 3, reply


def test_msgpack_claiming_huge_containers(peer):
    base = msgspec.msgpack.encode({"proto": 1, "op": "PUT", "id": 1})
    key = msgspec.msgpack.encode("trajs")
    for claim in (b"\xdd\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff"):
        reply = peer.ask([b"\x84" + base[1:] + key + claim])  # array32 / str32 / map32 of 4G
        assert_error(reply)  # truncated (BAD_FRAME) or not a list (BAD_HEADER); nothing allocated
        assert reply["code"] in ("BAD_FRAME", "BAD_HEADER"), reply
    reply = peer.ask([b"\xdf\xff\xff\xff\xff"])  # a header map of 4G entries
    assert reply["code"] == "BAD_FRAME" and "truncated" in reply["message"], reply


def test_too_many_trajectories_is_too_large(peer):
    trajs = [dict(META, traj_id=f"t{i}", group_id=f"g{i}", arrays=[]) for i in range(65)]
    reply = peer.ask([msgspec.msgpack.encode({"proto": 1, "op": "PUT", "id": 4, "trajs": trajs})])
    assert_error(reply)
    assert reply["code"] == "TOO_LARGE" and "max_batch" in reply["message"]


def test_a_message_above_max_message_bytes_closes_only_that_connection(shard_factory, zmq_ctx):
    shard = shard_factory(max_message_bytes=1 << 20)
    big, other = Peer(zmq_ctx, shard.endpoint), Peer(zmq_ctx, shard.endpoint)
    try:
        other.assert_serving()
        header = msgspec.msgpack.encode({"proto": 1, "op": "PING", "id": 1})
        assert big.ask([header, b"\x00" * (2 << 20)], timeout_ms=1000) is None  # dropped, no reply
        other.assert_serving()
        big.assert_serving()  # the DEALER reconnects; the shard serves it again
    finally:
        big.close()
        other.close()


def test_log_reader_rejects_garbage_without_other_errors():
    @settings(max_examples=300, deadline=None)
    @given(st.sampled_from([b"", b"SLG1", b"SLR1"]), st.binary(max_size=200))
    def check(magic, data):
        data = magic + data
        try:
            read_record(io.BytesIO(data), len(data), seed=1)
        except CorruptRecord:
            pass

    check()


def test_same_host_requests_without_the_token_are_refused(peer):
    """RESERVE needs the token only a process that can read the shard's token file has; a GET
    with a wrong token is served with frames, not references; a PUT naming a region this
    connection never reserved stores nothing."""
    reply = peer.ask([msgspec.msgpack.encode(VALID["RESERVE"][0])])
    assert_error(reply)
    assert reply["code"] == "NOT_SAME_HOST" and "token" in reply["message"], reply
    reply = peer.ask([msgspec.msgpack.encode(VALID["PUT_REGION"][0])])
    assert_error(reply)
    assert reply["code"] == "BAD_PAYLOAD" and "region=7" in reply["message"], reply
    hello = peer.ask([msgspec.msgpack.encode(VALID["HELLO"][0])])
    assert hello["ok"] and hello["op"] == "HELLO" and hello["token_file"] == "shard.token"
    assert "token" not in hello  # the token itself never travels in a reply
