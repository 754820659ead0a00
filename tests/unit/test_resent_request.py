"""A request the coordinator publishes again after a broker reconnection reaches a device that
completed the first copy (docs/PROTOCOL.md §5 Duplicates, §9 Broker reconnection)."""

from __future__ import annotations

import numpy as np

from coordinator.fleet.outbox import resent
from edge_sdk import wire
from edge_sdk.chunks import MIN_CHUNK_SIZE, Reassembler, chunk_from_dict, chunk_frames
from edge_sdk.protocol import COORDINATOR, Envelope, Kind

STREAM = "edgepfl/t/down/all/train"


def _blob_chunks(envelope: Envelope):
    return [chunk_from_dict(wire.unpack(frame)) for frame in chunk_frames(wire.encode(envelope), MIN_CHUNK_SIZE)]


def _delivered(reassembler: Reassembler, envelope: Envelope) -> list[Envelope]:
    return [wire.decode(out) for c in _blob_chunks(envelope) if (out := reassembler.add(STREAM, c)) is not None]


def test_a_resent_chunked_request_is_delivered_again_with_its_msg_id():
    # Prepare: a TRAIN large enough to be chunked, delivered once
    train = Envelope(Kind.TRAIN, COORDINATOR, run_id="r", round=3, config={"selected": ["dev0"]},
                     groups={"shared": {"w": np.arange(20_000, dtype=np.float32)}})
    reassembler = Reassembler(max_blob_bytes=1 << 22, max_pending_bytes=1 << 22)
    assert len(_delivered(reassembler, train)) == 1

    # Execute
    again = _delivered(reassembler, resent(train))
    stray = _delivered(reassembler, train)

    # Assert: the new copy arrives as the same request; byte-identical frames are still duplicates
    assert [e.msg_id for e in again] == [train.msg_id]
    assert again[0].timestamp > train.timestamp
    assert stray == []
