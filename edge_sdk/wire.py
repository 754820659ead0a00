"""Envelope <-> bytes, in msgpack; arrays travel as (dtype, shape, raw little-endian bytes).

Nothing is ever unpickled: decoding accepts only msgpack maps, lists, strings, numbers and
byte strings, checks every field, and raises `WireError` with a reason code on anything
malformed. Size limits are enforced before any decoding work is done.

Array data is not copied on either side. Encoding yields pieces (msgpack headers and views of
the arrays) that are joined once into the message, or cut into chunk frames directly.
Decoding returns byte strings of `ZERO_COPY_BYTES` or more as read-only memoryviews of the
received message, and arrays as numpy views on them: an update costs its message, once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from .protocol import PROTOCOL_VERSION, ArrayGroup, Envelope, Kind, Reason, WireError

# The only dtypes accepted on the wire, by name; all are sent little-endian.
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name).newbyteorder("<")
    for name in ("float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")
}
MAX_NDIM = 8
MAX_DIM = 2**40  # per dimension; keeps numpy from overflowing on zero-size arrays with huge dims
ZERO_COPY_BYTES = 1 << 16
"""msgpack bin values at least this long decode as read-only memoryviews, not copies."""


@dataclass(frozen=True)
class WireLimits:
    """Bounds every decoder enforces. Chunked payloads are bounded by `max_message_bytes` too."""

    max_message_bytes: int = 512 * 2**20
    max_string: int = 1 << 16
    max_items: int = 1 << 20  # entries in one msgpack list or map
    max_arrays: int = 1 << 16
    max_control_bytes: int = 64 << 10
    """HELLO, OFFLINE and FETCH: no arrays, a few settings."""
    max_eval_bytes: int = 64 << 20
    """EVAL_RES: metrics, and class prototypes or BatchNorm statistics where asked for."""

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_string", "max_items", "max_arrays", "max_control_bytes",
                     "max_eval_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"WireLimits.{name} must be positive")

    def for_kind(self, kind: Kind) -> int:
        """The largest message of `kind` a receiver takes, checked on its size alone (whole, or
        as a chunked blob's declared size) before anything is decoded."""
        if kind in (Kind.HELLO, Kind.OFFLINE, Kind.FETCH, Kind.NOTE):
            return min(self.max_control_bytes, self.max_message_bytes)
        if kind is Kind.EVAL_RES:
            return min(self.max_eval_bytes, self.max_message_bytes)
        return self.max_message_bytes


DEFAULT_LIMITS = WireLimits()


def encode_array(array: np.ndarray) -> dict[str, Any]:
    """One array as a msgpack map: dtype name, shape and raw little-endian bytes."""
    array = np.asarray(array)
    name = array.dtype.name
    if name not in DTYPES:
        raise TypeError(f"dtype {array.dtype} cannot travel; allowed: {sorted(DTYPES)}")
    # a byte view, not a copy: msgpack copies it once into the message
    data = np.ascontiguousarray(array, dtype=DTYPES[name]).reshape(-1).data.cast("B")
    return {"dtype": name, "shape": list(array.shape), "data": data}


def encode(envelope: Envelope) -> bytes:
    """Serialize an envelope; see docs/PROTOCOL.md for the layout."""
    return b"".join(encode_pieces(envelope))


def encode_pieces(envelope: Envelope) -> list[bytes | memoryview]:
    """The encoded envelope as consecutive pieces (array data as views of the arrays);
    `b"".join(pieces)` is exactly what `msgpack.packb` makes of `envelope_to_dict`."""
    pieces: list[bytes | memoryview] = []
    pack_pieces(envelope_to_dict(envelope), pieces)
    return pieces


class Joined(list):
    """Buffers that `pack_pieces` writes as one msgpack bin without joining them first."""


def pack_pieces(obj: Any, pieces: list[bytes | memoryview]) -> None:
    """Append the msgpack encoding of `obj` to `pieces`, leaving memoryviews and `Joined`
    buffers uncopied (as bin); everything else is packed by msgpack itself."""
    if isinstance(obj, dict):
        pieces.append(_map_header(len(obj)))
        for key, value in obj.items():
            pieces.append(msgpack.packb(key, use_bin_type=True))
            pack_pieces(value, pieces)
    elif isinstance(obj, (memoryview, Joined)):
        buffers = obj if isinstance(obj, Joined) else [obj]
        pieces.append(_bin_header(sum(len(buffer) for buffer in buffers)))
        pieces.extend(buffers)
    else:
        pieces.append(msgpack.packb(obj, use_bin_type=True))


def _map_header(length: int) -> bytes:
    """fixmap, map 16 or map 32, as msgpack writes them."""
    if length <= 15:
        return bytes([0x80 | length])
    return b"\xde" + length.to_bytes(2, "big") if length <= 0xFFFF else b"\xdf" + length.to_bytes(4, "big")


def _bin_header(length: int) -> bytes:
    """bin 8, bin 16 or bin 32, as msgpack writes them."""
    if length <= 0xFF:
        return b"\xc4" + bytes([length])
    return b"\xc5" + length.to_bytes(2, "big") if length <= 0xFFFF else b"\xc6" + length.to_bytes(4, "big")


def envelope_to_dict(envelope: Envelope) -> dict[str, Any]:
    return {
        "version": envelope.version,
        "kind": Kind(envelope.kind).value,
        "run_id": envelope.run_id,
        "round": int(envelope.round),
        "msg_id": envelope.msg_id,
        "sender": envelope.sender,
        "timestamp": float(envelope.timestamp),
        "groups": {
            group: {key: encode_array(value) for key, value in arrays.items()}
            for group, arrays in envelope.groups.items()
        },
        "metrics": {key: _number(key, value) for key, value in envelope.metrics.items()},
        "config": envelope.config,
    }


def _number(key: str, value: Any) -> float | int:
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}")


# msgpack header byte -> bytes of the length field for str and bin, and the fixed size of
# numbers; see the msgpack specification.
_LENGTH_PREFIXED = {0xc4: 1, 0xc5: 2, 0xc6: 4, 0xd9: 1, 0xda: 2, 0xdb: 4}
_BIN = (0xc4, 0xc5, 0xc6)
_FIXED = {0xca: 4, 0xcb: 8, 0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8, 0xd0: 1, 0xd1: 2, 0xd2: 4, 0xd3: 8}
_EXTENSIONS = (0xc7, 0xc8, 0xc9, 0xd4, 0xd5, 0xd6, 0xd7, 0xd8)
_CONTAINERS = {0xdc: (2, 1), 0xdd: (4, 1), 0xde: (2, 2), 0xdf: (4, 2)}  # (length bytes, items per entry)
_VIEW = 1  # extension type code of a large bin's stand-in while decoding (never accepted on the wire)


def prescan(data: bytes | memoryview) -> list[tuple[int, int, int]]:
    """Walk the msgpack headers without building anything and reject a document that declares
    more items than there are bytes left (every item takes at least one byte), or holds an
    extension type. This stops small inputs from making the decoder preallocate large
    containers. Returns (header, start, end) of every bin of `ZERO_COPY_BYTES` or more."""
    pos, pending, size = 0, 1, len(data)
    large: list[tuple[int, int, int]] = []
    while pending:
        if pos >= size:
            raise WireError(Reason.MALFORMED, "truncated msgpack document")
        header, byte = pos, data[pos]
        pos += 1
        pending -= 1
        if byte <= 0x7F or byte >= 0xE0 or byte in (0xC0, 0xC2, 0xC3):
            continue
        if 0x80 <= byte <= 0x9F:
            pending += (byte & 0x0F) * (2 if byte <= 0x8F else 1)
        elif 0xA0 <= byte <= 0xBF:
            pos += byte & 0x1F
        elif byte in _LENGTH_PREFIXED:
            width = _LENGTH_PREFIXED[byte]
            length = int.from_bytes(data[pos : pos + width], "big")
            pos += width + length
            if byte in _BIN and length >= ZERO_COPY_BYTES and pos <= size:
                large.append((header, pos - length, pos))
        elif byte in _FIXED:
            pos += _FIXED[byte]
        elif byte in _CONTAINERS:
            width, per_entry = _CONTAINERS[byte]
            pending += per_entry * int.from_bytes(data[pos : pos + width], "big")
            pos += width
        elif byte in _EXTENSIONS:
            raise WireError(Reason.MALFORMED, f"msgpack extension types are not allowed (header 0x{byte:02x})")
        else:
            raise WireError(Reason.MALFORMED, f"invalid msgpack header byte 0x{byte:02x}")
        if pending > size - pos:
            raise WireError(Reason.MALFORMED, "the document declares more items than it has bytes")
    if pos != size:
        raise WireError(Reason.MALFORMED, "extra bytes after the msgpack document")
    return large


def unpack(data: bytes | memoryview, limits: WireLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """msgpack bytes -> a map, with every container and string bounded; no extension types.
    Bins of `ZERO_COPY_BYTES` or more come back as read-only memoryviews of `data`."""
    if len(data) > limits.max_message_bytes:
        raise WireError(Reason.TOO_LARGE, f"{len(data)} bytes exceeds the limit of {limits.max_message_bytes}")
    large = prescan(data)
    views: list[memoryview] = []
    if large:
        whole = memoryview(data).toreadonly()
        views = [whole[start:end] for _, start, end in large]
        data = _with_stand_ins(whole, large)
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_bin_len=limits.max_message_bytes,
            max_str_len=limits.max_string,
            max_array_len=limits.max_items,
            max_map_len=limits.max_items,
            max_ext_len=4 if views else 0,
            ext_hook=lambda code, index: views[int.from_bytes(index, "big")],
        )
    except Exception as exc:  # msgpack raises many types for bad input; all mean "malformed"
        raise WireError(Reason.MALFORMED, f"not a msgpack document: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict):
        raise WireError(Reason.MALFORMED, f"top level must be a map, got {type(obj).__name__}")
    return obj


def _with_stand_ins(data: memoryview, large: list[tuple[int, int, int]]) -> bytes:
    """`data` with each large bin replaced by a 6-byte extension (fixext 4) holding its index:
    msgpack then decodes a small document, and the extension hook returns the view instead.
    Received documents cannot carry extensions (`prescan`), so every one here is a stand-in."""
    pieces: list[bytes | memoryview] = []
    last = 0
    for index, (header, _, end) in enumerate(large):
        pieces += [data[last:header], bytes([0xD6, _VIEW]) + index.to_bytes(4, "big")]
        last = end
    pieces.append(data[last:])
    return b"".join(pieces)


def decode(data: bytes | memoryview, limits: WireLimits = DEFAULT_LIMITS) -> Envelope:
    """Bytes -> Envelope, or `WireError`."""
    return envelope_from_dict(unpack(data, limits), limits)


def _field(obj: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in obj:
        raise WireError(Reason.MALFORMED, f"missing field {name!r}")
    value = obj[name]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise WireError(Reason.MALFORMED, f"field {name!r} has type {type(value).__name__}")
    return value


def envelope_from_dict(obj: dict[str, Any], limits: WireLimits = DEFAULT_LIMITS) -> Envelope:
    """Validate an unpacked map and build the Envelope."""
    version = _field(obj, "version", int)
    if version != PROTOCOL_VERSION:
        raise WireError(Reason.BAD_VERSION, f"protocol version {version}, this side speaks {PROTOCOL_VERSION}")
    try:
        kind = Kind(_field(obj, "kind", str))
    except ValueError:
        raise WireError(Reason.BAD_KIND, f"unknown kind {obj['kind']!r}") from None
    round_ = _field(obj, "round", int)
    if round_ < 0:
        raise WireError(Reason.MALFORMED, f"negative round {round_}")
    timestamp = _field(obj, "timestamp", (int, float))
    if isinstance(timestamp, bool):
        raise WireError(Reason.MALFORMED, "field 'timestamp' has type bool")
    groups = _decode_groups(_field(obj, "groups", dict), limits)
    metrics = _field(obj, "metrics", dict)
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise WireError(Reason.MALFORMED, f"metric name {key!r} is not a string")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise WireError(Reason.MALFORMED, f"metric {key!r} is not a number")
    return Envelope(
        kind=kind,
        sender=_field(obj, "sender", str),
        run_id=_field(obj, "run_id", str),
        round=round_,
        msg_id=_field(obj, "msg_id", str),
        timestamp=float(timestamp),
        groups=groups,
        metrics=metrics,
        config=_field(obj, "config", dict),
        version=version,
    )


def _decode_groups(raw: dict[str, Any], limits: WireLimits) -> dict[str, ArrayGroup]:
    groups: dict[str, ArrayGroup] = {}
    count = 0
    for group_name, arrays in raw.items():
        if not isinstance(arrays, dict) or not isinstance(group_name, str):
            raise WireError(Reason.MALFORMED, f"group {group_name!r} is not a named map")
        if not all(isinstance(key, str) for key in arrays):
            raise WireError(Reason.MALFORMED, f"group {group_name!r} has an array name that is not a string")
        count += len(arrays)
        if count > limits.max_arrays:
            raise WireError(Reason.TOO_LARGE, f"more than {limits.max_arrays} arrays")
        groups[group_name] = {key: decode_array(f"{group_name}/{key}", value) for key, value in arrays.items()}
    return groups


def decode_array(where: str, raw: Any) -> np.ndarray:
    """A (dtype, shape, data) map -> a read-only numpy view on the received bytes."""
    if not isinstance(raw, dict) or set(raw) != {"dtype", "shape", "data"}:
        raise WireError(Reason.MALFORMED, f"array {where} must be a map of dtype, shape, data")
    dtype = DTYPES.get(raw["dtype"]) if isinstance(raw["dtype"], str) else None
    if dtype is None:
        raise WireError(Reason.BAD_DTYPE, f"array {where} has dtype {raw['dtype']!r}; allowed: {sorted(DTYPES)}")
    shape = raw["shape"]
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(isinstance(dim, int) and not isinstance(dim, bool) and 0 <= dim <= MAX_DIM for dim in shape)
    ):
        raise WireError(Reason.BAD_SHAPE, f"array {where} has an invalid shape {shape!r}")
    data = raw["data"]
    if not isinstance(data, (bytes, memoryview)):
        raise WireError(Reason.MALFORMED, f"array {where} data is not a byte string")
    expected = math.prod(shape) * dtype.itemsize
    if expected != len(data):
        raise WireError(Reason.BAD_SHAPE, f"array {where}: shape {shape} needs {expected} bytes, got {len(data)}")
    try:
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    except (ValueError, OverflowError):
        raise WireError(Reason.BAD_SHAPE, f"array {where}: shape {shape} cannot be built") from None
