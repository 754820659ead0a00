"""Unit tests for edge_sdk.chunks: chunk frames and the bounded Reassembler (fake clock)."""

from __future__ import annotations

import dataclasses
import hashlib

import msgpack
import numpy as np
import pytest

from edge_sdk import wire
from edge_sdk.chunks import (
    MAX_CHUNK_SIZE,
    MIN_CHUNK_SIZE,
    Chunk,
    Reassembler,
    check_chunk_size,
    chunk_frames,
    chunk_from_dict,
    is_chunk_frame,
    iter_frames,
)
from edge_sdk.protocol import PROTOCOL_VERSION, ChunkError, Reason

CHUNK = MIN_CHUNK_SIZE  # 16 KiB, the smallest legal chunk size
STREAM = "edgepfl/t/down/all/train"


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _payload(size: int, seed: int = 7) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def _chunks(payload: bytes, chunk_size: int = CHUNK) -> list[Chunk]:
    return [chunk_from_dict(wire.unpack(frame)) for frame in chunk_frames(payload, chunk_size)]


def _reassembler(clock=None, drops=None, **kw) -> Reassembler:
    kw.setdefault("max_blob_bytes", 1 << 20)
    kw.setdefault("max_pending_bytes", 1 << 20)
    on_drop = drops.append if drops is not None else (lambda reason: None)
    return Reassembler(clock=clock or FakeClock(), on_drop=on_drop, **kw)


def _feed(reassembler: Reassembler, chunks: list[Chunk], stream: str = STREAM) -> list[bytes | memoryview]:
    """Every payload that `add` returned, in order."""
    return [out for c in chunks if (out := reassembler.add(stream, c)) is not None]


# -- chunk size and frames -----------------------------------------------------------------


@pytest.mark.parametrize("size", [MIN_CHUNK_SIZE, 128 << 10, 1 << 20, MAX_CHUNK_SIZE])
def test_chunk_size_in_bounds_is_allowed(size):
    assert check_chunk_size(size) == size


@pytest.mark.parametrize("size", [0, MIN_CHUNK_SIZE - 1, MAX_CHUNK_SIZE + 1, -CHUNK])
def test_chunk_size_out_of_bounds_is_refused(size):
    with pytest.raises(ValueError, match="chunk_size"):
        check_chunk_size(size)
    with pytest.raises(ValueError):
        chunk_frames(b"abc", size)


def test_frames_repeat_the_manifest_and_cover_the_payload():
    # Prepare: 4 full chunks and a 1000-byte tail
    payload = _payload(4 * CHUNK + 1000)

    # Execute
    chunks = _chunks(payload)

    # Assert
    assert len(chunks) == 5
    blob_id = hashlib.sha256(payload).hexdigest()
    assert all((c.blob_id, c.count, c.size) == (blob_id, 5, len(payload)) for c in chunks)
    assert [c.index for c in chunks] == [0, 1, 2, 3, 4]
    assert [len(c.data) for c in chunks] == [CHUNK] * 4 + [1000]
    assert b"".join(c.data for c in chunks) == payload


@pytest.mark.parametrize("cuts", [(), (1,), (CHUNK,), (5, CHUNK - 5, CHUNK + 3, 3 * CHUNK)],
                         ids=["one", "tiny", "aligned", "ragged"])
def test_frames_cut_from_pieces_equal_those_of_the_joined_payload(cuts):
    # Prepare: the payload split into pieces at `cuts` (as encode_pieces yields headers and arrays)
    payload = _payload(4 * CHUNK + 1000)
    bounds = [0, *cuts, len(payload)]
    pieces = [memoryview(payload)[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]

    # Execute
    frames = list(iter_frames(pieces, CHUNK))

    # Assert
    assert frames == chunk_frames(payload, CHUNK)


def test_a_small_payload_is_one_frame_and_frames_are_recognized():
    # Prepare / Execute
    frames = chunk_frames(b"hello", CHUNK)
    obj = wire.unpack(frames[0])

    # Assert
    assert len(frames) == 1 and is_chunk_frame(obj)
    assert not is_chunk_frame({"version": 1, "kind": "train"})
    assert _feed(_reassembler(), [chunk_from_dict(obj)]) == [b"hello"]


def test_empty_payload_round_trips():
    assert _feed(_reassembler(), _chunks(b"")) == [b""]


# -- reassembly orders ---------------------------------------------------------------------


def test_reassemble_in_order_completes_on_the_last_chunk():
    # Prepare
    payload = _payload(4 * CHUNK + 1000)
    chunks = _chunks(payload)
    reassembler = _reassembler()

    # Execute
    results = [reassembler.add(STREAM, c) for c in chunks]

    # Assert
    assert results[:-1] == [None] * 4
    assert results[-1] == payload
    assert reassembler.pending_bytes == 0


def test_reassemble_reversed():
    payload = _payload(3 * CHUNK + 5)
    assert _feed(_reassembler(), _chunks(payload)[::-1]) == [payload]


def test_a_reassembled_blob_is_read_only_and_a_whole_single_chunk_is_not_copied():
    payload = _payload(3 * CHUNK + 5)
    [blob] = _feed(_reassembler(), _chunks(payload))
    assert blob == payload and memoryview(blob).readonly
    with pytest.raises(TypeError):
        memoryview(blob)[0] = 1
    [single] = _chunks(_payload(CHUNK))
    assert _reassembler().add(STREAM, single) is single.data


def test_a_chunk_whose_writable_data_would_be_the_blob_is_copied():
    """The blob must not change under its decoded arrays: a writable part is never handed out."""
    [single] = _chunks(_payload(CHUNK))
    writable = bytearray(single.data)
    blob = _reassembler().add(STREAM, dataclasses.replace(single, data=memoryview(writable)))
    writable[0] ^= 0xFF
    assert blob == _payload(CHUNK) and memoryview(blob).readonly


@pytest.mark.parametrize("order", [[1, 0, 2, 3], [3, 2, 1, 0], [0, 2, 1, 3]])
def test_out_of_order_chunks_are_hashed_once_the_gap_fills(order):
    payload = _payload(3 * CHUNK + 9)
    chunks = _chunks(payload)
    assert _feed(_reassembler(), [chunks[i] for i in order]) == [payload]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reassemble_shuffled(seed):
    # Prepare
    payload = _payload(6 * CHUNK + 123, seed=seed)
    chunks = _chunks(payload)
    order = np.random.default_rng(seed).permutation(len(chunks))

    # Execute / Assert
    assert _feed(_reassembler(), [chunks[i] for i in order]) == [payload]


def test_reassemble_with_duplicates_delivers_once():
    # Prepare: every chunk twice, shuffled (QoS 1 redelivery)
    payload = _payload(4 * CHUNK + 77)
    chunks = _chunks(payload) * 2
    order = np.random.default_rng(5).permutation(len(chunks))
    reassembler = _reassembler()

    # Execute
    delivered = _feed(reassembler, [chunks[i] for i in order])

    # Assert
    assert delivered == [payload]
    assert reassembler.pending_bytes == 0


def test_a_duplicate_before_completion_is_not_counted_twice():
    # Prepare
    chunks = _chunks(_payload(3 * CHUNK))
    reassembler = _reassembler()

    # Execute
    reassembler.add(STREAM, chunks[0])
    reassembler.add(STREAM, chunks[0])

    # Assert
    assert reassembler.pending_bytes == CHUNK


def test_late_duplicate_after_completion_is_ignored():
    # Prepare
    payload = _payload(2 * CHUNK + 9)
    chunks = _chunks(payload)
    reassembler = _reassembler()
    assert _feed(reassembler, chunks) == [payload]

    # Execute
    late = [reassembler.add(STREAM, c) for c in chunks]

    # Assert: nothing delivered again, nothing left pending
    assert late == [None, None, None]
    assert reassembler.pending_bytes == 0


def test_same_blob_on_two_streams_is_reassembled_per_stream():
    # Prepare
    payload = _payload(2 * CHUNK + 1)
    chunks = _chunks(payload)
    reassembler = _reassembler()

    # Execute
    first = _feed(reassembler, chunks, stream="a")
    second = _feed(reassembler, chunks, stream="b")

    # Assert
    assert first == [payload] and second == [payload]


# -- bounds: time, size, memory ------------------------------------------------------------


def test_missing_chunk_never_completes_and_expires_after_ttl():
    # Prepare
    clock = FakeClock()
    drops: list[Reason] = []
    reassembler = _reassembler(clock, drops, ttl_seconds=30.0)
    chunks = _chunks(_payload(4 * CHUNK))
    assert _feed(reassembler, chunks[:-1]) == []  # the last chunk never comes
    assert reassembler.pending_bytes == 3 * CHUNK

    # Execute / Assert: at exactly the ttl it is still pending
    clock.now += 30.0
    reassembler.expire()
    assert drops == [] and reassembler.pending_bytes == 3 * CHUNK

    # Execute / Assert: past the ttl it is dropped and reported
    clock.now += 0.5
    reassembler.expire()
    assert drops == [Reason.CHUNK_EXPIRED]
    assert reassembler.pending_bytes == 0


def test_expiry_also_happens_on_the_next_add_and_a_straggler_does_not_complete():
    # Prepare
    clock = FakeClock()
    drops: list[Reason] = []
    reassembler = _reassembler(clock, drops, ttl_seconds=10.0)
    chunks = _chunks(_payload(3 * CHUNK))
    _feed(reassembler, chunks[:2])

    # Execute: the missing chunk arrives after the ttl
    clock.now += 11.0
    result = reassembler.add(STREAM, chunks[2])

    # Assert: the old parts were dropped; the straggler starts a new, incomplete blob
    assert result is None
    assert drops == [Reason.CHUNK_EXPIRED]
    assert reassembler.pending_bytes == CHUNK


def test_declared_size_over_the_blob_limit_is_overflow():
    # Prepare
    reassembler = _reassembler(max_blob_bytes=2 * CHUNK)
    chunks = _chunks(_payload(2 * CHUNK + 1))

    # Execute / Assert
    with pytest.raises(ChunkError) as info:
        reassembler.add(STREAM, chunks[0])
    assert info.value.reason is Reason.CHUNK_OVERFLOW
    assert reassembler.pending_bytes == 0


def test_pending_bytes_are_bounded_by_dropping_the_oldest_blob():
    # Prepare: room for 3 chunks; blob A holds 2, then blob B brings 2
    drops: list[Reason] = []
    reassembler = _reassembler(drops=drops, max_pending_bytes=3 * CHUNK)
    a, b = _chunks(_payload(3 * CHUNK, seed=1)), _chunks(_payload(3 * CHUNK, seed=2))
    _feed(reassembler, a[:2])

    # Execute
    _feed(reassembler, b[:2])

    # Assert: A was dropped, B kept
    assert drops == [Reason.CHUNK_OVERFLOW]
    assert reassembler.pending_bytes == 2 * CHUNK
    assert reassembler.add(STREAM, a[2]) is None  # A's remaining chunk cannot complete it any more
    assert reassembler.add(STREAM, b[2]) == b"".join(c.data for c in b)


def test_a_blob_that_alone_exceeds_the_budget_is_refused():
    # Prepare
    drops: list[Reason] = []
    reassembler = _reassembler(drops=drops, max_pending_bytes=2 * CHUNK)
    chunks = _chunks(_payload(3 * CHUNK))
    _feed(reassembler, chunks[:2])

    # Execute / Assert
    with pytest.raises(ChunkError) as info:
        reassembler.add(STREAM, chunks[2])
    assert info.value.reason is Reason.CHUNK_OVERFLOW
    assert reassembler.pending_bytes == 0


def test_number_of_pending_blobs_is_bounded():
    # Prepare
    drops: list[Reason] = []
    reassembler = _reassembler(drops=drops, max_pending_blobs=2)
    blobs = [_chunks(_payload(2 * CHUNK, seed=s)) for s in range(3)]

    # Execute
    for blob in blobs:
        reassembler.add(STREAM, blob[0])

    # Assert: the oldest was dropped
    assert drops == [Reason.CHUNK_OVERFLOW]
    assert reassembler.pending_bytes == 2 * CHUNK
    assert reassembler.add(STREAM, blobs[0][1]) is None
    assert reassembler.add(STREAM, blobs[2][1]) is not None


# -- invalid and corrupted chunks ----------------------------------------------------------


def test_chunk_disagreeing_with_the_manifest_is_invalid():
    # Prepare
    chunks = _chunks(_payload(3 * CHUNK))
    reassembler = _reassembler()
    reassembler.add(STREAM, chunks[0])
    liar = dataclasses.replace(chunks[1], count=4)

    # Execute / Assert
    with pytest.raises(ChunkError) as info:
        reassembler.add(STREAM, liar)
    assert info.value.reason is Reason.CHUNK_INVALID


def test_more_bytes_than_declared_is_invalid_and_drops_the_blob():
    # Prepare: a 3-chunk blob whose chunks are each as long as the whole declared size
    chunks = _chunks(_payload(3 * CHUNK))
    drops: list[Reason] = []
    reassembler = _reassembler(drops=drops)
    padded = [dataclasses.replace(c, data=bytes(c.data) * 3) for c in chunks]
    reassembler.add(STREAM, padded[0])

    # Execute / Assert
    with pytest.raises(ChunkError) as info:
        reassembler.add(STREAM, padded[1])
    assert info.value.reason is Reason.CHUNK_INVALID
    assert reassembler.pending_bytes == 0


def _frame(**changes) -> dict:
    body = {"blob": "ab" * 32, "index": 0, "count": 2, "size": CHUNK + 10, "data": b"01234"}
    body.update(changes)
    return {"version": PROTOCOL_VERSION, "chunk": body}


@pytest.mark.parametrize(
    "obj",
    [
        _frame(index=2),
        _frame(index=-1),
        _frame(count=0),
        _frame(size=-1),
        _frame(count=1, size=10, data=b"x" * 11),
        _frame(blob="short"),
        _frame(blob=5),
        _frame(index=True),
        _frame(index=1.0),
        _frame(data="01234"),
        {"version": PROTOCOL_VERSION, "chunk": [1, 2]},
        {"version": PROTOCOL_VERSION + 1, "chunk": _frame()["chunk"]},
    ],
    ids=["index-past-count", "negative-index", "zero-count", "negative-size", "data-over-size", "short-blob-id",
         "blob-not-str", "bool-index", "float-index", "data-not-bytes", "body-not-map", "bad-version"],
)
def test_inconsistent_or_mistyped_frame_is_invalid(obj):
    with pytest.raises(ChunkError) as info:
        chunk_from_dict(obj)
    assert info.value.reason is Reason.CHUNK_INVALID


def test_a_well_formed_frame_is_accepted():
    # The base of the invalid-frame cases is itself valid.
    chunk = chunk_from_dict(_frame())
    assert (chunk.index, chunk.count, chunk.size, chunk.data) == (0, 2, CHUNK + 10, b"01234")


def test_manifest_whose_count_cannot_match_its_size_is_invalid():
    # Prepare: a 100-byte blob announced as 1000 chunks. No sender can produce it (chunks are at
    # least MIN_CHUNK_SIZE), and its empty chunks would pile up without counting as pending bytes.
    obj = _frame(count=1000, size=100, data=b"")

    # Execute / Assert
    with pytest.raises(ChunkError) as info:
        chunk_from_dict(obj)
    assert info.value.reason is Reason.CHUNK_INVALID


def test_corrupted_data_fails_the_checksum():
    # Prepare: flip one byte of the middle chunk, keeping its length
    payload = _payload(3 * CHUNK)
    chunks = _chunks(payload)
    bad = bytearray(chunks[1].data)
    bad[100] ^= 0xFF
    chunks[1] = dataclasses.replace(chunks[1], data=bytes(bad))
    reassembler = _reassembler()
    _feed(reassembler, chunks[:2])

    # Execute / Assert
    with pytest.raises(ChunkError) as info:
        reassembler.add(STREAM, chunks[2])
    assert info.value.reason is Reason.CHUNK_CHECKSUM
    assert reassembler.pending_bytes == 0


def test_frames_decode_with_plain_msgpack():
    # A third-party client sees an ordinary msgpack map with a byte string.
    frame = msgpack.unpackb(chunk_frames(b"xyz", CHUNK)[0], raw=False)
    assert frame["chunk"]["data"] == b"xyz" and frame["version"] == PROTOCOL_VERSION


# -- a bad blob is one rejected message ----------------------------------------------------


def test_a_blob_over_the_limit_is_refused_once_however_many_of_its_chunks_arrive():
    # Prepare: 4 chunks of a blob larger than the receiver's limit for its kind
    chunks = _chunks(_payload(4 * CHUNK))
    reassembler = _reassembler()

    # Execute
    with pytest.raises(ChunkError) as info:
        reassembler.add(STREAM, chunks[0], limit=3 * CHUNK)
    later = [reassembler.add(STREAM, c, limit=3 * CHUNK) for c in chunks[1:]]

    # Assert: the first chunk raised, the others were dropped without a second refusal
    assert info.value.reason is Reason.TOO_LARGE
    assert later == [None, None, None]
    assert reassembler.pending_bytes == 0


def test_a_blob_that_failed_its_checksum_is_not_reported_again_when_its_chunks_return_and_expire():
    # Prepare: a blob whose middle chunk is damaged fails its checksum on completion
    clock = FakeClock()
    drops: list[Reason] = []
    reassembler = _reassembler(clock, drops, ttl_seconds=10.0)
    chunks = _chunks(_payload(3 * CHUNK))
    damaged = list(chunks)
    damaged[1] = dataclasses.replace(chunks[1], data=bytes(CHUNK))
    with pytest.raises(ChunkError) as info:
        _feed(reassembler, damaged)
    assert info.value.reason is Reason.CHUNK_CHECKSUM

    # Execute: a redelivered chunk of it starts a new, incomplete blob, which expires
    assert reassembler.add(STREAM, damaged[0]) is None
    clock.now += 11.0
    reassembler.expire()

    # Assert: counted once, as the checksum failure; the expiry of its remains is not reported
    assert drops == []
    assert reassembler.pending_bytes == 0


def test_an_intact_copy_of_a_refused_blob_is_still_delivered():
    # Prepare
    payload = _payload(3 * CHUNK)
    chunks = _chunks(payload)
    reassembler = _reassembler()
    with pytest.raises(ChunkError):
        _feed(reassembler, [chunks[0], dataclasses.replace(chunks[1], data=bytes(CHUNK)), chunks[2]])

    # Execute: the sender sends the same message again, intact
    delivered = _feed(reassembler, chunks)

    # Assert
    assert delivered == [payload]


def test_an_evicted_blob_is_reported_once_when_its_remaining_chunks_arrive_and_expire():
    # Prepare: room for 3 chunks; blob A (3 chunks) is evicted by blob B before its last chunk
    clock = FakeClock()
    drops: list[Reason] = []
    reassembler = _reassembler(clock, drops, max_pending_bytes=3 * CHUNK, ttl_seconds=10.0)
    a, b = _chunks(_payload(3 * CHUNK, seed=1)), _chunks(_payload(2 * CHUNK, seed=2))
    _feed(reassembler, a[:2])
    _feed(reassembler, b[:2])
    assert drops == [Reason.CHUNK_OVERFLOW]

    # Execute: A's last chunk arrives after all and can never complete
    assert reassembler.add(STREAM, a[2]) is None
    clock.now += 11.0
    reassembler.expire()

    # Assert: A counts once (the overflow); B, completed, not at all
    assert drops == [Reason.CHUNK_OVERFLOW]


def test_a_chunked_message_over_its_kinds_limit_counts_once_at_the_channel():
    # Prepare: an EVAL_RES of four 16 KiB frames, to a receiver that takes EVAL_RES up to 32 KiB
    from edge_sdk.channel import Channel
    from edge_sdk.loopback import LoopbackBroker
    from edge_sdk.protocol import Envelope, Kind, Topics

    broker, topics = LoopbackBroker(), Topics("countfed")
    receiver_transport, sender_transport = broker.transport("coordinator"), broker.transport("dev001")
    receiver_transport.connect()
    receiver_transport.subscribe(topics.all_up())
    sender_transport.connect()
    receiver = Channel(receiver_transport, topics, limits=wire.WireLimits(max_eval_bytes=2 * CHUNK))
    sender = Channel(sender_transport, topics, chunk_size=CHUNK)
    big = Envelope(Kind.EVAL_RES, "dev001", groups={"g": {"w": np.zeros(14_000, np.float32)}})
    sender.send(topics.up("dev001", Kind.EVAL_RES), big)
    sentinel = Envelope(Kind.HELLO, "dev001", metrics={"num_examples": 1})
    sender.send(topics.up("dev001", Kind.HELLO), sentinel)

    # Execute
    got = receiver.receive(timeout=10.0)

    # Assert: the sentinel came through; the four frames of the oversized message count as one
    assert got is not None and got.envelope.msg_id == sentinel.msg_id
    assert receiver.rejections == {"too_large": 1}
