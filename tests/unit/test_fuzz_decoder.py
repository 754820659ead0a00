"""Property-based fuzzing of everything that turns received bytes into objects.

`wire.decode` (arbitrary bytes, mutated envelopes, msgpack-valid structures of the wrong types,
adversarial array fields), its memory bounds, the absence of any code execution, chunk
reassembly under arbitrary frame sequences, and `Channel._accept` on arbitrary topics. The
rule everywhere: a valid object or a `ProtocolError` with a reason code, nothing else.
"""

from __future__ import annotations

import hashlib
import math
import pickle
import random
import struct
import time
import tracemalloc
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from edge_sdk import wire
from edge_sdk.channel import Channel, Received
from edge_sdk.chunks import MIN_CHUNK_SIZE, Reassembler, chunk_frames, chunk_from_dict, is_chunk_frame
from edge_sdk.loopback import LoopbackBroker, LoopbackTransport
from edge_sdk.protocol import (
    PROTOCOL_VERSION,
    ChunkError,
    Envelope,
    Kind,
    ProtocolError,
    Reason,
    Topics,
    WireError,
)

FUZZ = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
FEDERATION = "fz"


def fuzz(examples: int) -> settings:
    return settings(FUZZ, max_examples=examples)

TOPICS = Topics(FEDERATION)


# -- strategies ----------------------------------------------------------------------------

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.binary(max_size=24)
)
_keys = st.text(max_size=8) | st.binary(max_size=8) | st.integers(-5, 5)

msgpack_values = st.recursive(
    _scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(_keys, children, max_size=4),
    max_leaves=12,
)
"""Anything msgpack can carry (maps may have str, bin or int keys)."""


def _base_envelopes() -> list[Envelope]:
    rng = np.random.default_rng(20240601)
    return [
        Envelope(Kind.HELLO, "dev001", msg_id="h-1", timestamp=1.7e9,
                 metrics={"num_examples": 120, "num_test": 30},
                 config={"device_type": "trainer", "algorithms": ["fedavg", "fedper"], "torch": "2.3"}),
        Envelope(Kind.TRAIN_RES, "dev001", run_id="0123456789abcdef", round=3, msg_id="t-1", timestamp=1.7e9,
                 groups={"shared": {
                     "body.0.weight": rng.standard_normal((2, 3)).astype(np.float32),
                     "head.bias": np.arange(3, dtype=np.float16),
                     "steps": np.array([1, 2**40], dtype=np.int64),
                     "mask": np.array([True, False]),
                     "scalar": np.array(2.5),
                     "empty": np.zeros((0, 4), dtype=np.float32),
                 }},
                 metrics={"num_examples": 120, "loss": 0.25}),
        Envelope(Kind.EVAL_RES, "dev001", run_id="0123456789abcdef", round=3, msg_id="e-1", timestamp=1.7e9,
                 metrics={"accuracy": 0.75, "num_test": 30}),
        Envelope(Kind.OFFLINE, "dev001", msg_id="o-1", timestamp=1.7e9),
    ]


BASES = _base_envelopes()
ENCODED = [wire.encode(e) for e in BASES]
BASE_DICTS = [wire.envelope_to_dict(e) for e in BASES]


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys / list indices) to a value inside a nested dict/list, the root excluded."""
    out = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        out.append(prefix + (key,))
        out.extend(_paths(value, prefix + (key,)))
    return out


def _copy(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy(v) for v in obj]
    return obj


@st.composite
def byte_mutations(draw) -> bytes:
    """A valid encoded envelope with bit flips, truncation, insertion, deletion or splicing."""
    data = bytearray(draw(st.sampled_from(ENCODED)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "overwrite", "splice"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del data[pos:]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[pos:pos + draw(st.integers(1, 16))]
        elif op == "overwrite" and data:
            data[pos] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0x90, 0xA0, 0xC0, 0xC1, 0xC2, 0xC6, 0xC7,
                                              0xCB, 0xCF, 0xD3, 0xD9, 0xDB, 0xDD, 0xDF, 0xFF]))
        elif op == "splice":
            other = draw(st.sampled_from(ENCODED))
            cut = draw(st.integers(0, len(other)))
            data[pos:] = other[cut:]
    return bytes(data)


@st.composite
def structural_mutations(draw) -> dict:
    """A valid envelope map with values replaced, removed or added: valid msgpack, wrong types."""
    obj = _copy(draw(st.sampled_from(BASE_DICTS)))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(obj)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = obj
        for key in path[:-1]:
            parent = parent[key]
        op = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        if op == "replace":
            parent[path[-1]] = draw(msgpack_values)
        elif op == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif op == "add" and isinstance(parent, dict):
            parent[draw(_keys)] = draw(msgpack_values)
    return obj


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# -- helpers -------------------------------------------------------------------------------


def _assert_envelope(envelope: Any) -> None:
    """What `decode` returns is an Envelope whose fields have the types the receivers rely on."""
    assert type(envelope) is Envelope
    assert isinstance(envelope.kind, Kind)
    assert envelope.version == PROTOCOL_VERSION
    for name in ("sender", "run_id", "msg_id"):
        assert type(getattr(envelope, name)) is str
    assert type(envelope.round) is int and envelope.round >= 0
    assert type(envelope.timestamp) is float
    assert isinstance(envelope.config, dict)
    assert isinstance(envelope.metrics, dict)
    for value in envelope.metrics.values():
        assert type(value) in (int, float)
    assert isinstance(envelope.groups, dict)
    for arrays in envelope.groups.values():
        assert isinstance(arrays, dict)
        for array in arrays.values():
            assert isinstance(array, np.ndarray) and array.dtype in wire.DTYPES.values()


def _assert_documented_key_types(envelope: Envelope) -> None:
    """docs/PROTOCOL.md §3: groups are `map str -> (map str -> array)`, metrics `map str -> number`."""
    assert all(type(k) is str for k in envelope.groups), f"group names {list(envelope.groups)!r}"
    for arrays in envelope.groups.values():
        assert all(type(k) is str for k in arrays), f"array names {list(arrays)!r}"
    assert all(type(k) is str for k in envelope.metrics), f"metric names {list(envelope.metrics)!r}"


def _decode(data: bytes, limits: wire.WireLimits = wire.DEFAULT_LIMITS) -> Envelope | None:
    """The decoded envelope, or None for a rejection; anything else escapes and fails the test."""
    try:
        envelope = wire.decode(data, limits)
    except WireError as err:
        assert isinstance(err.reason, Reason)
        return None
    _assert_envelope(envelope)
    return envelope


# -- 1. arbitrary bytes and mutations ------------------------------------------------------


@fuzz(300)
@given(st.binary(max_size=512))
@example(b"")
@example(b"\x80")  # an empty map
@example(b"\xc1")  # the one byte msgpack never uses
def test_arbitrary_bytes_decode_to_an_envelope_or_a_wire_error(data):
    _decode(data)


@fuzz(300)
@given(byte_mutations())
def test_byte_mutations_of_valid_envelopes_decode_or_are_rejected(data):
    _decode(data)


@fuzz(300)
@given(structural_mutations())
def test_valid_msgpack_with_wrong_types_decodes_or_is_rejected(obj):
    _decode(_pack(obj))


@fuzz(150)
@given(structural_mutations())
@example({**BASE_DICTS[2], "metrics": {"accuracy": 0.5, b"accuracy": 1}})
@example({**BASE_DICTS[1], "groups": {b"shared": {b"w": wire.encode_array(np.zeros(2, np.float32))}}})
def test_decoded_envelopes_have_the_documented_str_keys(obj):
    # PROTOCOL.md §3 types groups and metrics as maps with str keys; msgpack's strict_map_key
    # still lets bin keys through, and a bytes metric name later breaks json in report.json.
    envelope = _decode(_pack(obj))
    if envelope is not None:
        _assert_documented_key_types(envelope)


_dims = (
    st.integers(0, 5)
    | st.sampled_from([0, 1, 2**31, 2**32, 2**40 - 1, 2**40, 2**40 + 1, 2**63 - 1, 2**64 - 1])
    | st.integers(-(2**63), 2**64 - 1)
)
_dtypes = st.sampled_from(sorted(wire.DTYPES)) | st.sampled_from(
    ["float128", "complex64", "object", "O", "<f4", ">f8", "V8", "U4", "S3", "datetime64", ""]
) | msgpack_values


@fuzz(300)
@given(_dtypes, st.lists(_dims, max_size=10) | msgpack_values, st.none() | st.binary(max_size=64) | msgpack_values)
@example("float64", [0, 2**40, 2**40], None)  # a zero-size array whose other dimensions overflow numpy
@example("uint8", [0] + [2**40] * 7, None)
def test_adversarial_array_fields_decode_or_are_rejected(dtype, shape, data):
    # data None: exactly the byte count that dtype and shape call for (when that is small)
    if data is None:
        exact = isinstance(dtype, str) and dtype in wire.DTYPES and isinstance(shape, list) and all(
            type(d) is int for d in shape)
        needed = math.prod(shape) * wire.DTYPES[dtype].itemsize if exact else 0
        data = bytes(needed) if 0 <= needed <= 1 << 16 else b""
    obj = _copy(BASE_DICTS[1])
    obj["groups"]["shared"]["fuzzed"] = {"dtype": dtype, "shape": shape, "data": data}

    envelope = _decode(_pack(obj))

    if envelope is not None:
        array = envelope.groups["shared"]["fuzzed"]
        assert list(array.shape) == shape and array.nbytes == len(data)


# -- 2. bounded memory ---------------------------------------------------------------------

_GIB4 = b"\xff\xff\xff\xff"


def _with_truncated_array_data(header: bytes) -> bytes:
    """A valid TRAIN_RES cut right after an array's `data` key, followed by `header` + a few bytes."""
    encoded = ENCODED[1]
    at = encoded.index(b"\xa4data") + 5
    return encoded[:at] + header + b"\x00" * 8


FLAT_BOMBS = {
    "bin32 claiming 4 GiB": b"\xc6" + _GIB4 + b"x" * 16,
    "str32 claiming 4 GiB": b"\xdb" + _GIB4 + b"x" * 16,
    "array32 claiming 4 Gi items": b"\xdd" + _GIB4 + b"\xc0" * 16,
    "map32 claiming 4 Gi entries": b"\xdf" + _GIB4 + b"\xc0" * 16,
    "ext32 claiming 4 GiB": b"\xc9" + _GIB4 + b"\x01",
    "array32 of max_items, empty body": b"\xdd" + struct.pack(">I", wire.DEFAULT_LIMITS.max_items),
    "map32 of max_items, empty body": b"\xdf" + struct.pack(">I", wire.DEFAULT_LIMITS.max_items),
    "envelope whose array data claims 4 GiB": _with_truncated_array_data(b"\xc6" + _GIB4),
    "envelope whose array data claims 256 MiB": _with_truncated_array_data(b"\xc6\x10\x00\x00\x00"),
    "envelope whose shape claims max_items dims": _with_truncated_array_data(b"\xdd\x00\x10\x00\x00"),
    "map of 1000 keys each claiming a 4 GiB str": b"\xde\x03\xe8" + (b"\xa1k\xdb" + _GIB4) * 1000,
}

NESTED_BOMBS = {
    # each level is a 5-byte header; msgpack preallocates the list before reading its items
    "1000 nested array32 headers of max_items": (b"\xdd" + struct.pack(">I", 1 << 20)) * 1000,
    "500 nested {k: array32} levels": (b"\x81\xa1k\xdd" + struct.pack(">I", 1 << 20)) * 500,
}

MEMORY_SLACK = 1 << 20  # the "small constant": interpreter noise, exception objects, one small list


def _peak_allocation(data: bytes) -> tuple[int, float, Reason | None]:
    tracemalloc.start()
    started = time.perf_counter()
    try:
        wire.decode(data)
        reason = None
    except WireError as err:
        reason = err.reason
    finally:
        seconds = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak, seconds, reason


@pytest.mark.parametrize("name", sorted(FLAT_BOMBS))
def test_huge_declared_lengths_are_rejected_quickly_without_allocating(name):
    data = FLAT_BOMBS[name]

    peak, seconds, reason = _peak_allocation(data)

    assert reason is not None, "a truncated/bogus document must be rejected"
    assert peak < 10 * len(data) + MEMORY_SLACK, f"{name}: {peak} bytes allocated for {len(data)} input bytes"
    assert seconds < 0.5


@pytest.mark.parametrize("name", sorted(NESTED_BOMBS))
def test_nested_container_headers_do_not_amplify_memory(name):
    # A few KB of nested container headers make msgpack preallocate ~80 KB per level before it
    # notices that the input is incomplete: ~80 MB (and ~0.1 s) for 5 KB of input.
    data = NESTED_BOMBS[name]

    peak, _, reason = _peak_allocation(data)

    assert reason is Reason.MALFORMED
    assert peak < 10 * len(data) + MEMORY_SLACK, f"{name}: {peak / 1e6:.1f} MB allocated for {len(data)} input bytes"


SMALL = wire.WireLimits(max_message_bytes=4096, max_string=256, max_items=64, max_arrays=8)


_LENGTH_MARKERS = {b"\xc5": 2, b"\xda": 2, b"\xdc": 2, b"\xde": 2, b"\xc6": 4, b"\xdb": 4, b"\xdd": 4,
                   b"\xdf": 4, b"\xc8": 2, b"\xc9": 4}  # bin, str, array, map, ext: 16- and 32-bit lengths


@fuzz(100)
@given(st.sampled_from(sorted(_LENGTH_MARKERS)), st.data(), st.binary(max_size=64))
def test_small_limits_reject_large_declared_lengths(marker, data_strategy, body):
    width = _LENGTH_MARKERS[marker]
    declared = data_strategy.draw(st.integers(SMALL.max_message_bytes + 1, (1 << 8 * width) - 1))
    header = marker + declared.to_bytes(width, "big")
    for data in (header + body, _with_truncated_array_data(header) + body):
        if len(data) > SMALL.max_message_bytes:
            continue
        with pytest.raises(WireError):
            wire.decode(data, SMALL)


@fuzz(50)
@given(st.integers(SMALL.max_message_bytes + 1, 3 * SMALL.max_message_bytes))
def test_small_limits_reject_large_payloads_before_parsing(size):
    obj = _copy(BASE_DICTS[1])
    obj["config"]["blob"] = b"\x00" * size  # a perfectly valid envelope, only too large

    with pytest.raises(WireError) as info:
        wire.decode(_pack(obj), SMALL)

    assert info.value.reason is Reason.TOO_LARGE


def test_small_limits_bound_strings_containers_and_array_counts():
    cases = {
        "long str": {**BASE_DICTS[3], "sender": "x" * (SMALL.max_string + 1)},
        "long list": {**BASE_DICTS[3], "config": {"l": [0] * (SMALL.max_items + 1)}},
        "many arrays": {**BASE_DICTS[3], "groups": {"g": {
            f"a{i}": wire.encode_array(np.zeros(0, np.uint8)) for i in range(SMALL.max_arrays + 1)}}},
    }
    for name, obj in cases.items():
        assert _decode(_pack(obj), SMALL) is None, name


# -- 3. nothing is ever executed -----------------------------------------------------------

SIDE_EFFECTS: list[str] = []


def _record_side_effect(tag: str) -> str:
    SIDE_EFFECTS.append(tag)
    return tag


class _Exploit:
    def __reduce__(self):
        return (_record_side_effect, ("code ran",))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_payloads_are_rejected_and_never_executed(protocol):
    SIDE_EFFECTS.clear()
    payload = pickle.dumps(_Exploit(), protocol=protocol)
    hidden = _copy(BASE_DICTS[0])
    hidden["config"]["state"] = payload  # pickle bytes inside a bin field: carried, never loaded
    hidden["groups"] = {"g": {"blob": wire.encode_array(np.frombuffer(payload, dtype=np.uint8))}}

    with pytest.raises(ProtocolError):
        wire.decode(payload)
    with pytest.raises(ProtocolError):
        wire.decode(b"\x81\xa1p" + payload)  # a map whose value starts like a pickle
    envelope = wire.decode(_pack(hidden))

    assert SIDE_EFFECTS == []
    assert envelope.config["state"] == payload
    pickle.loads(payload)  # the control: the payload is live when unpickled
    assert SIDE_EFFECTS == ["code ran"]


def _ext(code: int, data: bytes) -> bytes:
    """Raw msgpack ext8 bytes: any type code, reserved negative ones included."""
    return b"\xc7" + bytes([len(data)]) + code.to_bytes(1, "big", signed=True) + data


_PLACEHOLDER = b"<placeholder-for-an-ext-value>"


@fuzz(100)
@given(st.integers(-128, 127), st.binary(max_size=40), st.sampled_from(["top", "config", "metric", "array data"]))
def test_msgpack_extension_types_are_rejected(code, data, where):
    obj = _copy(BASE_DICTS[1])
    if where == "config":
        obj["config"]["x"] = [1, {"y": _PLACEHOLDER}]
    elif where == "metric":
        obj["metrics"]["loss"] = _PLACEHOLDER
    elif where == "array data":
        obj["groups"]["shared"]["head.bias"]["data"] = _PLACEHOLDER
    packed = _ext(code, data) if where == "top" else _pack(obj).replace(
        b"\xc4" + bytes([len(_PLACEHOLDER)]) + _PLACEHOLDER, _ext(code, data))

    with pytest.raises(WireError) as info:
        wire.decode(packed)

    assert info.value.reason is Reason.MALFORMED


def test_msgpack_timestamps_are_rejected():
    obj = {**BASE_DICTS[3], "config": {"when": msgpack.Timestamp(1_700_000_000, 5)}}

    with pytest.raises(WireError):
        wire.decode(msgpack.packb(obj, use_bin_type=True, datetime=False))


# -- 4. chunk reassembly -------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def _frame(blob: str, index: int, count: int, size: int, data: Any) -> dict:
    return {"version": PROTOCOL_VERSION, "chunk": {"blob": blob, "index": index, "count": count,
                                                   "size": size, "data": data}}


_hex64 = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)
_corruptions = st.sampled_from(
    ["index", "count", "size", "blob", "blob_other", "blob_upper", "blob_newline", "data_flip", "data_grow",
     "data_cut", "data_type", "version", "drop_key", "chunk_type", "anything"]
)
_ops = st.tuples(
    st.sampled_from(["valid", "valid", "valid", "duplicate", "corrupt", "manifest", "tick"]),
    st.integers(0, 2),  # which original
    st.integers(0, 7),  # which frame of it
    st.sampled_from(["s/a", "s/b"]),  # which stream (topic)
    _corruptions,
    st.integers(-(2**40), 2**40),
    _scalars | st.lists(_scalars, max_size=3) | st.dictionaries(st.text(max_size=5), _scalars, max_size=3),
)


def _corrupt(frame: dict, how: str, number: int, value: Any, other_blob: str) -> Any:
    frame = _copy(frame)
    body = frame["chunk"]
    if how in ("index", "count", "size"):
        body[how] = number
    elif how == "blob":
        body["blob"] = value
    elif how == "blob_other":
        body["blob"] = other_blob
    elif how == "blob_upper":
        body["blob"] = body["blob"].upper()
    elif how == "blob_newline":
        body["blob"] += "\n"
    elif how == "data_flip" and body["data"]:
        data = bytearray(body["data"])
        data[abs(number) % len(data)] ^= 0x01
        body["data"] = bytes(data)
    elif how == "data_grow":
        body["data"] += b"\x00" * (abs(number) % 64 + 1)
    elif how == "data_cut":
        body["data"] = body["data"][: abs(number) % (len(body["data"]) + 1)]
    elif how == "data_type":
        body["data"] = value
    elif how == "version":
        frame["version"] = value
    elif how == "drop_key":
        del body[sorted(body)[abs(number) % len(body)]]
    elif how == "chunk_type":
        frame["chunk"] = value
    elif how == "anything":
        return value
    return frame


MAX_BLOB = 40_000
PENDING_BUDGET = 56 << 10


@fuzz(120)
@given(
    st.lists(st.tuples(st.integers(0, MAX_BLOB), st.integers(0, 2**32)), min_size=1, max_size=3),
    st.lists(_ops, max_size=30),
    _hex64,
)
def test_chunk_sequences_never_crash_and_stay_within_budget(originals, ops, random_blob):
    # Prepare: payloads of up to 3 chunks, framed by the real sender at the smallest chunk size
    payloads = [_payload(size, seed) for size, seed in originals]
    frames = [[msgpack.unpackb(f, raw=False) for f in chunk_frames(p, MIN_CHUNK_SIZE)] for p in payloads]
    by_digest = {hashlib.sha256(p).hexdigest(): p for p in payloads}
    clock = _Clock()
    drops: list[Reason] = []
    reassembler = Reassembler(max_blob_bytes=MAX_BLOB, max_pending_bytes=PENDING_BUDGET, max_pending_blobs=2,
                              ttl_seconds=10.0, on_drop=drops.append, clock=clock)
    last = None

    for op, which, index, stream, how, number, value in ops:
        original = frames[which % len(frames)]
        frame = original[index % len(original)]
        if op == "tick":
            clock.now += abs(number) % 15
            continue
        if op == "duplicate" and last is not None:
            frame = last
        elif op == "corrupt":
            frame = _corrupt(frame, how, number, value, random_blob)
        elif op == "manifest":
            frame = _copy(frame)
            frame["chunk"]["count"] += 1 + abs(number) % 3
            frame["chunk"]["size"] += abs(number) % 7
        last = frame

        # Execute: the channel's path (msgpack bytes -> map -> chunk -> reassembler)
        try:
            obj = wire.unpack(_pack(frame))
            if not is_chunk_frame(obj):
                continue
            out = reassembler.add(stream, chunk_from_dict(obj))
        except WireError:
            continue
        except ChunkError as err:
            assert isinstance(err.reason, Reason)
            out = None

        # Assert
        assert 0 <= reassembler.pending_bytes <= PENDING_BUDGET
        if out is not None:
            assert by_digest.get(hashlib.sha256(out).hexdigest()) == out
    assert all(isinstance(reason, Reason) for reason in drops)

    # Liveness: once everything pending expires, a clean sequence on a fresh stream completes.
    clock.now += 1000
    reassembler.expire()
    assert reassembler.pending_bytes == 0
    results = [reassembler.add("s/final", chunk_from_dict(f)) for f in reversed(frames[0])]
    assert results[-1] == payloads[0]


def test_real_chunk_frames_survive_reordering_and_duplication():
    payload = np.random.default_rng(5).integers(0, 256, 40_000, dtype=np.uint8).tobytes()
    frames = chunk_frames(payload, 16 << 10)
    reassembler = Reassembler(max_blob_bytes=1 << 20, max_pending_bytes=1 << 20)
    order = [2, 0, 0, 2, 1]

    results = [reassembler.add("s", chunk_from_dict(wire.unpack(frames[i]))) for i in order]

    assert results == [None, None, None, None, payload]


@pytest.mark.parametrize("blob", ["a" * 64 + "\n", "a" * 63, "A" * 64, "g" * 64, ""])
def test_chunk_blob_ids_are_exactly_64_lowercase_hex_characters(blob):
    # PROTOCOL.md §5: `blob` must be a str of 64 characters; a trailing newline makes 65.
    with pytest.raises(ChunkError):
        chunk = chunk_from_dict(_frame(blob, 0, 1, 1, b"x"))
        assert len(chunk.blob_id) == 64  # (reached only when the frame was accepted)


# -- 5. the channel --------------------------------------------------------------------------

_ids = st.sampled_from(["dev001", "dev002", "coordinator", "all", "x" * 65, "ünï", "a b", ""]) | st.text(max_size=10)
_topics = (
    st.builds(lambda i, k: TOPICS.up(i, k), _ids, st.sampled_from(list(Kind)))
    | st.builds(lambda i, k: TOPICS.down(i, k), _ids, st.sampled_from(list(Kind)))
    | st.builds(lambda fed, rest: f"edgepfl/{fed}/{rest}", st.text(max_size=6), st.text(max_size=20))
    | st.text(max_size=40)
)
_payloads = st.binary(max_size=256) | byte_mutations() | structural_mutations().map(_pack)


def _channel() -> tuple[Channel, LoopbackTransport]:
    broker = LoopbackBroker()
    receiver = broker.transport("receiver")
    receiver.connect()
    receiver.subscribe("#")
    publisher = broker.transport("publisher")
    publisher.connect()
    return Channel(receiver, TOPICS, limits=wire.WireLimits(max_message_bytes=1 << 16)), publisher


def _is_chunk_frame(payload: bytes) -> bool:
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception:
        return False
    return isinstance(obj, dict) and "chunk" in obj


@fuzz(250)
@given(st.lists(st.tuples(_topics, _payloads), min_size=1, max_size=6))
def test_channel_accept_never_raises_and_counts_every_rejection(messages):
    channel, publisher = _channel()

    for topic, payload in messages:
        before, duplicates = sum(channel.rejections.values()), channel.duplicates
        publisher.publish(topic, payload, qos=0)

        received = channel.receive(timeout=0)

        counted = sum(channel.rejections.values()) - before + channel.duplicates - duplicates
        if received is not None:
            assert isinstance(received, Received) and received.topic == topic
            _assert_envelope(received.envelope)
            assert received.envelope.kind is received.address.kind
            assert counted == 0
        elif payload and not _is_chunk_frame(payload):
            assert counted == 1, f"{topic!r}: {payload[:40]!r} vanished without a count"
    assert set(channel.rejections) <= {r.value for r in Reason}


@fuzz(100)
@given(_dtypes, st.lists(_dims, min_size=1, max_size=9))
@example("float64", [0, 2**40, 2**40])
def test_channel_survives_adversarial_arrays_from_a_device(dtype, shape):
    channel, publisher = _channel()
    obj = _copy(BASE_DICTS[1])
    obj["groups"]["shared"]["fuzzed"] = {"dtype": dtype, "shape": shape, "data": b""}

    publisher.publish(TOPICS.up("dev001", Kind.TRAIN_RES), _pack(obj))
    received = channel.receive(timeout=0)

    assert received is not None or sum(channel.rejections.values()) == 1
