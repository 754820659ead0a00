"""Unit tests for edge_sdk.wire: Envelope <-> bytes, and every way bytes get rejected."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from edge_sdk import wire
from edge_sdk.protocol import PROTOCOL_VERSION, Envelope, Kind, Reason, WireError


def _sample_envelope() -> Envelope:
    rng = np.random.default_rng(1234)
    return Envelope(
        Kind.TRAIN_RES,
        "dev001",
        run_id="run-abc",
        round=3,
        msg_id="m-1",
        timestamp=1_700_000_000.25,
        groups={
            "shared": {
                "body.0.weight": rng.standard_normal((4, 3, 2, 2)).astype(np.float32),
                "head.bias": np.array([0.5, -1.25, 65504.0], dtype=np.float16),
                "steps": np.array([1, -2, 2**40], dtype=np.int64),
            },
            "stats": {
                "counts": np.array([[0, 7], [255, 1]], dtype=np.uint8),
                "mask": np.array([True, False, True]),
                "scalar": np.array(2.5, dtype=np.float32),  # 0-d
                "empty": np.zeros((0, 5), dtype=np.float32),
            },
        },
        metrics={"num_examples": 450, "loss": 0.125, "flag": True},
        config={"selected": ["dev001", "dev002"], "nested": {"lr": 0.1, "levels": [1, {"deep": "yes"}]}},
    )


def _valid_dict() -> dict:
    return wire.envelope_to_dict(
        Envelope(Kind.TRAIN, "coordinator", run_id="r", round=1, msg_id="m",
                 groups={"g": {"w": np.array([1.0, 2.0], dtype=np.float32)}}, metrics={"x": 1.0})
    )


def _reason(data: bytes, limits: wire.WireLimits = wire.DEFAULT_LIMITS) -> Reason:
    with pytest.raises(WireError) as info:
        wire.decode(data, limits)
    return info.value.reason


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# -- round trip ----------------------------------------------------------------------------


def test_round_trip_keeps_every_field_and_array():
    # Prepare
    sent = _sample_envelope()

    # Execute
    got = wire.decode(wire.encode(sent))

    # Assert
    assert (got.kind, got.sender, got.run_id, got.round, got.msg_id) == (Kind.TRAIN_RES, "dev001", "run-abc", 3, "m-1")
    assert got.timestamp == 1_700_000_000.25
    assert got.version == PROTOCOL_VERSION
    assert got.metrics == {"num_examples": 450, "loss": 0.125, "flag": 1}
    assert got.config == {"selected": ["dev001", "dev002"], "nested": {"lr": 0.1, "levels": [1, {"deep": "yes"}]}}
    assert set(got.groups) == {"shared", "stats"}
    for group, arrays in sent.groups.items():
        assert set(got.groups[group]) == set(arrays)
        for key, original in arrays.items():
            received = got.groups[group][key]
            assert received.dtype.name == original.dtype.name, key
            assert received.shape == original.shape, key
            np.testing.assert_array_equal(received, original)


def test_round_trip_zero_d_and_empty_arrays_keep_their_shapes():
    # Prepare
    sent = _sample_envelope()

    # Execute
    got = wire.decode(wire.encode(sent)).groups["stats"]

    # Assert
    assert got["scalar"].shape == () and float(got["scalar"]) == 2.5
    assert got["empty"].shape == (0, 5) and got["empty"].size == 0


def test_arrays_come_back_little_endian_even_when_sent_big_endian():
    # Prepare
    big = np.array([1.5, -2.0, 3.25], dtype=">f4")
    big_int = np.array([1, 256, -3], dtype=">i8")
    sent = Envelope(Kind.TRAIN, "coordinator", groups={"g": {"f": big, "i": big_int}})

    # Execute
    payload = wire.encode(sent)
    got = wire.decode(payload).groups["g"]

    # Assert
    for key, original in (("f", big), ("i", big_int)):
        assert got[key].dtype == got[key].dtype.newbyteorder("<"), key  # native little-endian
        np.testing.assert_array_equal(got[key], original)
    assert np.array([1.5, -2.0, 3.25], dtype="<f4").tobytes() in payload


def test_decoded_arrays_are_read_only_views():
    # Prepare
    payload = wire.encode(Envelope(Kind.TRAIN, "coordinator", groups={"g": {"w": np.ones(3, np.float32)}}))

    # Execute
    array = wire.decode(payload).groups["g"]["w"]

    # Assert
    assert not array.flags.writeable


def test_encoding_in_pieces_is_exactly_msgpack_and_leaves_array_data_uncopied():
    # Prepare: map and bin headers of every width (fix, 8, 16 and 32 bits)
    envelope = _sample_envelope()
    envelope.groups["sizes"] = {f"a{n}": np.zeros(n, np.uint8) for n in (0, 255, 256, 65535, 65536)}
    envelope.config["wide"] = {str(i): i for i in range(70_000)}

    # Execute
    pieces = wire.encode_pieces(envelope)

    # Assert
    assert b"".join(pieces) == wire.encode(envelope) == _pack(wire.envelope_to_dict(envelope))
    weight = envelope.groups["shared"]["body.0.weight"]
    assert any(isinstance(p, memoryview) and np.shares_memory(np.frombuffer(p, np.uint8), weight) for p in pieces)


def test_large_arrays_decode_as_views_of_the_message_and_small_ones_as_copies():
    # Prepare: one array over the zero-copy size, one under it, and a large bin in config
    big = np.arange(wire.ZERO_COPY_BYTES, dtype=np.float32)
    payload = bytearray(wire.encode(Envelope(Kind.TRAIN_RES, "dev001", groups={"g": {"big": big, "small": big[:8]}},
                                             config={"blob": b"x" * wire.ZERO_COPY_BYTES})))

    # Execute
    envelope = wire.decode(memoryview(payload))

    # Assert: values intact; the large array shares the message's memory and cannot write to it
    got = envelope.groups["g"]
    np.testing.assert_array_equal(got["big"], big)
    np.testing.assert_array_equal(got["small"], big[:8])
    message = np.frombuffer(payload, np.uint8)
    assert np.shares_memory(got["big"], message) and not np.shares_memory(got["small"], message)
    assert not got["big"].flags.writeable and not got["small"].flags.writeable
    assert isinstance(envelope.config["blob"], memoryview) and envelope.config["blob"] == b"x" * wire.ZERO_COPY_BYTES


def test_wire_overhead_of_a_4mb_float32_array_is_below_one_per_mille():
    # Prepare
    array = np.random.default_rng(0).standard_normal(2**20).astype(np.float32)  # 4 MiB
    envelope = Envelope(Kind.TRAIN_RES, "dev001", run_id="run", round=1, groups={"shared": {"w": array}},
                        metrics={"num_examples": 100})

    # Execute
    encoded = wire.encode(envelope)

    # Assert
    assert envelope.array_bytes() == 4 * 2**20
    assert len(encoded) / envelope.array_bytes() < 1.001


# -- encode refuses what cannot travel ------------------------------------------------------


@pytest.mark.parametrize(
    "array",
    [np.array([object(), 1], dtype=object), np.array([1 + 2j]), np.array(["ab"], dtype="<U8")],
    ids=["object", "complex", "unicode"],
)
def test_encode_refuses_arrays_that_cannot_travel(array):
    # Prepare
    envelope = Envelope(Kind.TRAIN, "coordinator", groups={"g": {"x": array}})

    # Execute / Assert
    with pytest.raises(TypeError):
        wire.encode(envelope)


def test_encode_refuses_a_string_metric():
    # Prepare
    envelope = Envelope(Kind.TRAIN_RES, "dev001", metrics={"loss": "low"})  # type: ignore[dict-item]  # a string, on purpose

    # Execute / Assert
    with pytest.raises(TypeError, match="loss"):
        wire.encode(envelope)


# -- decode rejections ----------------------------------------------------------------------


def test_too_large_is_rejected_before_decoding():
    # Prepare: garbage that would be MALFORMED if the decoder looked at it
    limits = wire.WireLimits(max_message_bytes=64)
    data = b"\xc1" * 65

    # Execute / Assert
    assert _reason(data, limits) is Reason.TOO_LARGE
    assert _reason(b"\xc1" * 64, limits) is Reason.MALFORMED  # at the limit: decoded (and malformed)


@pytest.mark.parametrize(
    "data",
    [b"\xc1", b"", b"\x92\x01", _pack({"a": 1}) + b"\x00"],
    ids=["never-used-byte", "empty", "truncated-list", "trailing-bytes"],
)
def test_not_msgpack_is_malformed(data):
    assert _reason(data) is Reason.MALFORMED


@pytest.mark.parametrize("top", [[1, 2], "text", 7, None], ids=["list", "str", "int", "nil"])
def test_top_level_must_be_a_map(top):
    assert _reason(_pack(top)) is Reason.MALFORMED


@pytest.mark.parametrize(
    "field", ["version", "kind", "run_id", "round", "msg_id", "sender", "timestamp", "groups", "metrics", "config"]
)
def test_missing_field_is_malformed(field):
    # Prepare
    obj = _valid_dict()
    del obj[field]

    # Execute / Assert
    with pytest.raises(WireError) as info:
        wire.decode(_pack(obj))
    assert info.value.reason is Reason.MALFORMED
    assert field in str(info.value)


@pytest.mark.parametrize(
    "field, value",
    [("round", -1), ("round", True), ("round", "1"), ("sender", 5), ("groups", []), ("config", [1])],
)
def test_field_of_wrong_type_or_range_is_malformed(field, value):
    # Prepare
    obj = _valid_dict()
    obj[field] = value

    # Execute / Assert
    assert _reason(_pack(obj)) is Reason.MALFORMED


def test_valid_dict_decodes():
    # The base of the rejection tests is itself accepted.
    got = wire.decode(_pack(_valid_dict()))
    assert got.kind is Kind.TRAIN and got.groups["g"]["w"].tolist() == [1.0, 2.0]


@pytest.mark.parametrize("version", [0, 2, PROTOCOL_VERSION + 1])
def test_wrong_version_is_bad_version(version):
    # Prepare
    obj = _valid_dict()
    obj["version"] = version

    # Execute / Assert
    assert _reason(_pack(obj)) is Reason.BAD_VERSION


def test_unknown_kind_is_bad_kind():
    # Prepare
    obj = _valid_dict()
    obj["kind"] = "reboot"

    # Execute / Assert
    assert _reason(_pack(obj)) is Reason.BAD_KIND


def _with_array(raw: dict) -> bytes:
    obj = _valid_dict()
    obj["groups"] = {"g": {"w": raw}}
    return _pack(obj)


@pytest.mark.parametrize("dtype", ["object", "<U8", "complex128", "complex64", "float128", "O", 5, None])
def test_disallowed_dtype_is_bad_dtype(dtype):
    raw = {"dtype": dtype, "shape": [1], "data": b"\x00" * 16}
    assert _reason(_with_array(raw)) is Reason.BAD_DTYPE


@pytest.mark.parametrize(
    "shape, data",
    [([3], b"\x00" * 8), ([2, 2], b"\x00" * 20), ([], b""), ([0], b"\x00" * 4)],
    ids=["short", "long", "0-d-without-data", "empty-with-data"],
)
def test_shape_and_data_length_mismatch_is_bad_shape(shape, data):
    raw = {"dtype": "float32", "shape": shape, "data": data}
    assert _reason(_with_array(raw)) is Reason.BAD_SHAPE


def test_negative_dims_are_bad_shape():
    raw = {"dtype": "float32", "shape": [-1, -2], "data": b"\x00" * 8}
    assert _reason(_with_array(raw)) is Reason.BAD_SHAPE


def test_too_many_dims_are_bad_shape():
    # Prepare: 9 dims of 1, data consistent with the shape
    raw = {"dtype": "float32", "shape": [1] * (wire.MAX_NDIM + 1), "data": b"\x00" * 4}

    # Execute / Assert
    assert _reason(_with_array(raw)) is Reason.BAD_SHAPE
    ok = {"dtype": "float32", "shape": [1] * wire.MAX_NDIM, "data": b"\x00" * 4}
    assert wire.decode(_with_array(ok)).groups["g"]["w"].ndim == wire.MAX_NDIM


@pytest.mark.parametrize("shape", [[1.0], ["2"], [True], 4], ids=["float", "str", "bool", "not-a-list"])
def test_non_integer_dims_are_bad_shape(shape):
    raw = {"dtype": "uint8", "shape": shape, "data": b"\x00"}
    assert _reason(_with_array(raw)) is Reason.BAD_SHAPE


@pytest.mark.parametrize(
    "shape",
    [[2**64 - 1, 0], [2**40, 2**40, 0], [2**40] * 3 + [0], [2**32, 2**32, 0]],
    ids=["one-huge-dim", "two-2^40-dims", "three-2^40-dims", "two-2^32-dims"],
)
def test_zero_size_array_with_huge_dims_is_rejected_as_bad_shape(shape):
    # Prepare: prod(shape) == 0 so the byte count matches, but numpy cannot build the shape.
    # Anything but WireError escapes Channel._accept and kills the receiving loop.
    raw = {"dtype": "float32", "shape": shape, "data": b""}

    # Execute / Assert
    assert _reason(_with_array(raw)) is Reason.BAD_SHAPE


@pytest.mark.parametrize(
    "raw",
    [{"dtype": "float32", "shape": [1]}, {"dtype": "float32", "shape": [1], "data": "abcd"}, [1, 2]],
    ids=["no-data", "data-is-str", "not-a-map"],
)
def test_malformed_array_map_is_malformed(raw):
    assert _reason(_with_array(raw)) is Reason.MALFORMED


@pytest.mark.parametrize("value", ["0.5", None, [1.0], True], ids=["str", "nil", "list", "bool"])
def test_metric_that_is_not_a_number_is_malformed(value):
    # Prepare
    obj = _valid_dict()
    obj["metrics"] = {"loss": value}

    # Execute / Assert
    with pytest.raises(WireError) as info:
        wire.decode(_pack(obj))
    assert info.value.reason is Reason.MALFORMED
    assert "loss" in str(info.value)


def test_ext_type_with_data_is_malformed():
    # Prepare
    obj = _valid_dict()
    obj["config"] = {"x": msgpack.ExtType(1, b"abc")}

    # Execute / Assert
    assert _reason(_pack(obj)) is Reason.MALFORMED


@pytest.mark.parametrize("where", ["config", "metrics", "top"])
def test_empty_ext_type_is_malformed(where):
    # Prepare: an ext of length 0 slips past max_ext_len=0, but the wire admits no ext at all.
    obj = _valid_dict()
    ext = msgpack.ExtType(7, b"")
    if where == "top":
        obj["extra"] = ext
    else:
        obj[where] = {"x": ext}

    # Execute / Assert
    assert _reason(_pack(obj)) is Reason.MALFORMED


def test_too_many_arrays_is_too_large():
    # Prepare
    limits = wire.WireLimits(max_arrays=2)
    arrays = {f"a{i}": np.zeros(1, np.uint8) for i in range(3)}
    payload = wire.encode(Envelope(Kind.TRAIN, "coordinator", groups={"g1": arrays}))

    # Execute / Assert
    assert _reason(payload, limits) is Reason.TOO_LARGE
    assert len(wire.decode(payload).groups["g1"]) == 3  # the default limit admits it


def test_string_longer_than_limit_is_malformed():
    # Prepare
    limits = wire.WireLimits(max_string=16)
    payload = wire.encode(Envelope(Kind.TRAIN, "coordinator", run_id="r" * 17))

    # Execute / Assert
    assert _reason(payload, limits) is Reason.MALFORMED


def test_wire_limits_must_be_positive():
    with pytest.raises(ValueError, match="max_string"):
        wire.WireLimits(max_string=0)
