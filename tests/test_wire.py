"""The wire protocol: header + raw array frames round trip, and strict validation."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from sluice.trajectory import Trajectory, from_wire_batch, to_wire_batch
from sluice.wire import codec
from sluice.wire.messages import PROTO_VERSION, ArraySpec, GetRequest, PutRequest


def make_traj(i: int, n: int = 5, group: str = "g0", group_size: int = 1, version: int = 3) -> Trajectory:
    rng = np.random.default_rng(i)
    return Trajectory(
        traj_id=f"t{i}",
        group_id=group,
        version=version,
        group_size=group_size,
        reward=0.25 * i,
        info={"exact": 1.0, "truncated": False, "note": "x"},
        arrays={
            "prompt_ids": rng.integers(0, 100, size=4, dtype=np.int32),
            "completion_ids": rng.integers(0, 100, size=n, dtype=np.int32),
            "behaviour_logprobs": rng.standard_normal(n).astype(np.float32),
            "obs": rng.standard_normal((n, 3, 2)).astype(np.float64),
            "empty": np.zeros((0,), dtype=np.int64),
            "mask": rng.integers(0, 2, size=n).astype(bool),
        },
    )


def test_put_round_trip_keeps_every_array_bit_exact():
    trajs = [make_traj(i, n=3 + i) for i in range(4)]
    metas, payload = to_wire_batch(trajs)
    frames = codec.encode(PutRequest(proto=PROTO_VERSION, id=7, trajs=metas), payload)
    # what the network delivers is bytes
    frames = [bytes(f) for f in frames]
    header, rest = codec.decode_request(frames)
    assert isinstance(header, PutRequest) and header.id == 7
    back = from_wire_batch(header.trajs, rest)
    for a, b in zip(trajs, back):
        assert (a.traj_id, a.group_id, a.version, a.reward, a.info) == (
            b.traj_id,
            b.group_id,
            b.version,
            b.reward,
            b.info,
        )
        assert a.arrays.keys() == b.arrays.keys()
        for k in a.arrays:
            assert a.arrays[k].dtype == b.arrays[k].dtype
            assert a.arrays[k].shape == b.arrays[k].shape
            assert a.arrays[k].tobytes() == b.arrays[k].tobytes()


def test_arrays_are_zero_copy_views_of_frames():
    t = make_traj(0)
    _, payload = t.to_wire()
    frame = bytes(payload[1])
    spec = t.to_wire()[0].arrays[1]
    view = codec.view_array(spec, frame)
    assert not view.flags.writeable  # a view of the frame, not a copy


def test_header_validation_names_the_field():
    raw = msgspec.msgpack.encode({"proto": 1, "op": "GET", "id": 3, "max_trajs": "many"})
    with pytest.raises(codec.ProtocolError) as e:
        codec.decode_request([raw])
    assert e.value.code == "BAD_HEADER"
    assert "max_trajs" in e.value.message
    assert e.value.request_id == 3


def test_unknown_op_and_unknown_field_are_rejected():
    for bad in (
        {"proto": 1, "op": "DELETE_ALL", "id": 1},
        {"proto": 1, "op": "PING", "id": 1, "surprise": True},
    ):
        with pytest.raises(codec.ProtocolError) as e:
            codec.decode_request([msgspec.msgpack.encode(bad)])
        assert e.value.code == "BAD_HEADER"


def test_non_msgpack_and_wrong_version():
    with pytest.raises(codec.ProtocolError) as e:
        codec.decode_request([b"\xc1\xc1not msgpack"])
    assert e.value.code == "BAD_FRAME"
    with pytest.raises(codec.ProtocolError) as e:
        codec.decode_request([msgspec.msgpack.encode({"proto": 99, "op": "PING", "id": 4})])
    assert e.value.code == "PROTO_VERSION" and e.value.request_id == 4


def test_arrays_laid_back_to_back_are_viewed_as_the_frames_are():
    """`view_arrays` (a same-host GET: a trajectory's arrays in one mapped region) gives the
    arrays `view_array` gives frame by frame: every dtype and shape, an empty array, an N-d
    one, at their offsets, read-only when the region is."""
    t = make_traj(2, n=4)
    meta, payload = t.to_wire()
    sizes = codec.spec_sizes(meta.arrays, "trajs[0]")
    assert sizes == [len(codec.frame_bytes(f)) for f in payload]
    region = memoryview(b"".join(bytes(f) for f in payload))
    views = codec.view_arrays(meta.arrays, region)
    assert list(views) == list(t.arrays)
    for name, array in t.arrays.items():
        assert views[name].dtype == array.dtype and views[name].shape == array.shape
        assert np.array_equal(views[name], array)
        assert not views[name].flags.writeable
    negative = [ArraySpec(name="x", dtype="int32", shape=[2, -1])]
    with pytest.raises(codec.ProtocolError, match=r"trajs\[3\]\.arrays\[0\]\.shape=\[2, -1\] is negative"):
        codec.spec_sizes(negative, "trajs[3]")


def test_payload_length_mismatch_names_the_frame():
    t = make_traj(1)
    metas, payload = to_wire_batch([t])
    payload[2] = bytes(payload[2])[:-4]
    with pytest.raises(codec.ProtocolError) as e:
        codec.split_payload(metas, payload)
    assert e.value.code == "BAD_PAYLOAD"
    assert "frame 3" in e.value.message and "behaviour_logprobs" in e.value.message
    with pytest.raises(codec.ProtocolError) as e:
        codec.split_payload(metas, payload[:-1])
    assert "announces 6 array frames, message carries 5" in e.value.message


def test_bad_dtype_is_rejected():
    bad = msgspec.msgpack.encode(
        {
            "proto": 1,
            "op": "PUT",
            "id": 1,
            "trajs": [
                {
                    "traj_id": "a",
                    "group_id": "g",
                    "version": 0,
                    "arrays": [{"name": "x", "dtype": "complex128", "shape": [2]}],
                }
            ],
        }
    )
    header, payload = codec.decode_request([bad, b"0" * 32])
    with pytest.raises(codec.ProtocolError) as e:
        codec.split_payload(header.trajs, payload)
    assert "trajs[0].arrays[0].dtype" in e.value.message


def test_get_request_defaults():
    h = GetRequest(proto=PROTO_VERSION, id=1, max_trajs=8)
    back, _ = codec.decode_request(codec.encode(h))
    assert back == h and back.min_version == 0 and back.policy_id == "default"
