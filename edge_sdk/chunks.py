"""Splitting large payloads into chunk frames and reassembling them, bounded in memory and time.

A payload larger than the chunk size travels as `count` chunk frames on the same topic. Every
frame repeats the manifest (blob id = sha256 of the whole payload, total size, count), so the
receiver needs no separate manifest message and tolerates duplicated and reordered chunks.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import msgpack
import numpy as np

from . import wire
from .protocol import PROTOCOL_VERSION, ChunkError, Reason

MIN_CHUNK_SIZE = 16 << 10
MAX_CHUNK_SIZE = 64 << 20
DEFAULT_CHUNK_SIZE = 1 << 20
"""The coordinator's: broadcasts travel in 1 MiB messages, which suit brokers and small devices."""
DEFAULT_UPLOAD_CHUNK_SIZE = MAX_CHUNK_SIZE
"""A device's: an update of up to 64 MiB travels as one MQTT message. Uploads from a whole fleet
interleave at the broker, so chunked ones would make the coordinator hold part of every
device's update at once; whole ones it takes one at a time."""
_HEX64 = re.compile(r"[0-9a-f]{64}")


def check_chunk_size(size: int, name: str = "chunk_size") -> int:
    if not MIN_CHUNK_SIZE <= size <= MAX_CHUNK_SIZE:
        raise ValueError(f"{name} must be between {MIN_CHUNK_SIZE} and {MAX_CHUNK_SIZE} bytes, got {size}")
    return size


@dataclass(frozen=True)
class Chunk:
    """One piece of a blob; `blob_id` is the sha256 hex digest of the whole payload."""

    blob_id: str
    index: int
    count: int
    size: int
    data: bytes | memoryview


def chunk_frames(payload: bytes, chunk_size: int = DEFAULT_CHUNK_SIZE) -> list[bytes]:
    """The frames to publish for `payload` (a single frame is still a valid 1-chunk blob)."""
    return list(iter_frames([payload], chunk_size))


def iter_frames(pieces: Sequence[bytes | memoryview], chunk_size: int = DEFAULT_CHUNK_SIZE) -> Iterator[bytes]:
    """The frames of the payload `b"".join(pieces)`, made one at a time straight from the
    pieces (as `wire.encode_pieces` yields them), so the whole payload is never built."""
    check_chunk_size(chunk_size)
    views = [memoryview(piece).cast("B") for piece in pieces]
    digest = hashlib.sha256()
    for view in views:
        digest.update(view)
    blob_id, size = digest.hexdigest(), sum(len(view) for view in views)
    count = max(1, math.ceil(size / chunk_size))
    slices = _slices(views, chunk_size)
    for index in range(count):
        frame: list[bytes | memoryview] = []
        wire.pack_pieces({"version": PROTOCOL_VERSION, "chunk": {"blob": blob_id, "index": index, "count": count,
                                                                  "size": size, "data": next(slices)}}, frame)
        yield b"".join(frame)


def _slices(views: list[memoryview], length: int) -> Iterator[wire.Joined]:
    """Consecutive runs of `length` bytes (the last shorter, one empty run for no bytes)."""
    run, room = wire.Joined(), length
    for view in views:
        while len(view) > room:
            run.append(view[:room])
            yield run
            view, run, room = view[room:], wire.Joined(), length
        if len(view):
            run.append(view)
            room -= len(view)
    yield run


FRAME_PREFIX = b"\x82" + b"".join(msgpack.packb(item) for item in ("version", PROTOCOL_VERSION, "chunk"))
"""The bytes every chunk frame starts with, as `iter_frames` writes it (docs/PROTOCOL.md section 5)."""


def is_chunk_frame(obj: dict[str, Any]) -> bool:
    return "chunk" in obj


def _is_int(value: Any) -> TypeGuard[int]:
    """An int of the wire (msgpack's bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def chunk_from_dict(obj: dict[str, Any]) -> Chunk:
    """Validate an unpacked chunk frame."""
    raw = obj.get("chunk")
    version = obj.get("version")
    if type(version) is not int or version != PROTOCOL_VERSION or not isinstance(raw, dict):
        raise ChunkError(Reason.CHUNK_INVALID, "chunk frame without a valid version or body")
    blob, index, count, size, data = (raw.get(k) for k in ("blob", "index", "count", "size", "data"))
    if not (isinstance(blob, str) and _HEX64.fullmatch(blob) and _is_int(index) and _is_int(count)
            and _is_int(size) and isinstance(data, (bytes, memoryview))):
        raise ChunkError(Reason.CHUNK_INVALID, "chunk fields missing or of the wrong type")
    plausible_count = count <= max(1, math.ceil(size / MIN_CHUNK_SIZE)) and (size == 0 or data)
    if not (count >= 1 and 0 <= index < count and size >= 0 and len(data) <= size and plausible_count):
        raise ChunkError(Reason.CHUNK_INVALID, f"chunk {index}/{count} of a {size}-byte blob is inconsistent")
    return Chunk(blob, index, count, size, data)


def _joined(parts: list[bytes | memoryview]) -> bytes | memoryview:
    """The parts as one read-only blob: a read-only part itself, uncopied; else copied into one
    numpy buffer (numpy asks the kernel for huge pages: a bytes join of 50 MB spends more time
    faulting 4 KiB pages in than copying)."""
    if len(parts) == 1 and (isinstance(parts[0], bytes) or parts[0].readonly):
        return parts[0]
    buffer, offset = np.empty(sum(len(part) for part in parts), np.uint8).data, 0
    for part in parts:
        buffer[offset:offset + len(part)] = part
        offset += len(part)
    return buffer.toreadonly()


@dataclass
class _Pending:
    count: int
    size: int
    started: float
    parts: dict[int, bytes | memoryview] = field(default_factory=dict)
    received: int = 0
    digest: Any = field(default_factory=hashlib.sha256)
    """sha256 of parts 0 .. hashed - 1, taken as they arrive: the last one's wait is short."""
    hashed: int = 0


class Reassembler:
    """Collects chunks per (stream, blob id) until complete; bounded in bytes, blobs and age.

    `add` returns the whole payload (read-only) once its last chunk arrives and its sha256
    matches; it raises `ChunkError` for a chunk that must be rejected. The sha256 is taken as
    the chunks arrive (each once the ones before it are in), the blob joined only once it
    matches. Blobs that overflow memory or outlive
    `ttl_seconds` are dropped and reported through `on_drop(reason)`.

    A bad blob is one rejected message, counted once however many of its chunks arrive: after
    the first refusal of a (stream, blob id) (raised or reported), its later chunks that fail
    too are dropped without a second report (the last `REMEMBERED` such blobs). A chunk that
    would complete it is still taken: a whole, intact copy sent again is delivered.
    """

    REMEMBERED = 1024

    def __init__(
        self,
        *,
        max_blob_bytes: int,
        max_pending_bytes: int,
        max_pending_blobs: int = 64,
        ttl_seconds: float = 120.0,
        on_drop: Callable[[Reason], None] = lambda reason: None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_blob_bytes = max_blob_bytes
        self.max_pending_bytes = max_pending_bytes
        self.max_pending_blobs = max_pending_blobs
        self.ttl_seconds = ttl_seconds
        self._on_drop = on_drop
        self._clock = clock
        self._pending: OrderedDict[tuple[str, str], _Pending] = OrderedDict()
        self._pending_bytes = 0
        self._done: deque[tuple[str, str]] = deque(maxlen=self.REMEMBERED)
        self._done_set: set[tuple[str, str]] = set()
        self._refused: deque[tuple[str, str]] = deque(maxlen=self.REMEMBERED)
        self._refused_set: set[tuple[str, str]] = set()

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    @property
    def pending_blobs(self) -> int:
        """Blobs partly received, waiting for their other chunks."""
        return len(self._pending)

    def add(self, stream: str, chunk: Chunk, *, limit: int | None = None) -> bytes | memoryview | None:
        """The whole blob (read-only) once `chunk` completes it, else None; `ChunkError` for the
        first refusal of its blob (`too_large` when its declared size exceeds `limit`)."""
        self.expire()
        key = (stream, chunk.blob_id)
        try:
            return self._add(key, chunk, limit)
        except ChunkError:
            if self._first_refusal(key):
                raise
            return None  # this blob was refused, and counted, before

    def _first_refusal(self, key: tuple[str, str]) -> bool:
        """Remember that blob `key` was refused; False when it had been already."""
        if key in self._refused_set:
            return False
        if len(self._refused) == self._refused.maxlen:
            self._refused_set.discard(self._refused[0])
        self._refused.append(key)
        self._refused_set.add(key)
        return True

    def _add(self, key: tuple[str, str], chunk: Chunk, limit: int | None) -> bytes | memoryview | None:
        if key in self._done_set:
            return None  # a late duplicate of a blob already delivered
        if limit is not None and chunk.size > limit:
            raise ChunkError(Reason.TOO_LARGE, f"a chunked message of {chunk.size} bytes, the limit is {limit}")
        if chunk.size > self.max_blob_bytes:
            raise ChunkError(Reason.CHUNK_OVERFLOW, f"blob of {chunk.size} bytes exceeds {self.max_blob_bytes}")
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = _Pending(chunk.count, chunk.size, self._clock())
        elif (pending.count, pending.size) != (chunk.count, chunk.size):
            raise ChunkError(Reason.CHUNK_INVALID, f"chunk disagrees with blob {chunk.blob_id[:12]}'s manifest")
        if chunk.index in pending.parts:
            return None  # duplicate delivery (QoS 1)
        if pending.received + len(chunk.data) > pending.size:
            self._drop(key, Reason.CHUNK_INVALID, notify=False)  # the caller's ChunkError reports it
            raise ChunkError(Reason.CHUNK_INVALID, f"blob {chunk.blob_id[:12]} received more bytes than declared")
        pending.parts[chunk.index] = chunk.data
        pending.received += len(chunk.data)
        self._pending_bytes += len(chunk.data)
        self._enforce_bounds(keep=key)
        while pending.hashed in pending.parts:  # in order, each part is hashed as it arrives
            pending.digest.update(pending.parts[pending.hashed])
            pending.hashed += 1
        if len(pending.parts) < pending.count:
            return None
        return self._complete(key, pending)

    def _complete(self, key: tuple[str, str], pending: _Pending) -> bytes | memoryview:
        del self._pending[key]
        self._pending_bytes -= pending.received
        if pending.received != pending.size or pending.digest.hexdigest() != key[1]:
            raise ChunkError(Reason.CHUNK_CHECKSUM, f"blob {key[1][:12]} does not match its sha256")
        payload = _joined([pending.parts[i] for i in range(pending.count)])
        if len(self._done) == self._done.maxlen:
            self._done_set.discard(self._done[0])
        self._done.append(key)
        self._done_set.add(key)
        return payload

    def _enforce_bounds(self, keep: tuple[str, str]) -> None:
        """Drop the oldest other blobs while over the byte or count budget."""
        while self._pending_bytes > self.max_pending_bytes or len(self._pending) > self.max_pending_blobs:
            victim = next((k for k in self._pending if k != keep), keep)
            self._drop(victim, Reason.CHUNK_OVERFLOW, notify=victim != keep)
            if victim == keep:
                raise ChunkError(Reason.CHUNK_OVERFLOW, "blob does not fit in the reassembly budget")

    def _drop(self, key: tuple[str, str], reason: Reason, *, notify: bool = True) -> None:
        """Forget a pending blob; `notify` reports it (not when the caller raises for it anyway)."""
        pending = self._pending.pop(key)
        self._pending_bytes -= pending.received
        if notify and self._first_refusal(key):
            self._on_drop(reason)

    def expire(self) -> None:
        now = self._clock()
        for key in [k for k, p in self._pending.items() if now - p.started > self.ttl_seconds]:
            self._drop(key, Reason.CHUNK_EXPIRED)
