"""Unit tests for Channel.send: whole messages, chunking, and the broker's packet limit."""

from __future__ import annotations

import numpy as np
import pytest

from edge_sdk import wire
from edge_sdk.channel import Channel
from edge_sdk.chunks import MIN_CHUNK_SIZE, chunk_from_dict, is_chunk_frame
from edge_sdk.counters import ByteCounter
from edge_sdk.flow import IncomingQueue
from edge_sdk.protocol import Envelope, Kind, Topics
from edge_sdk.transport import Incoming

TOPICS = Topics("f")
TOPIC = TOPICS.up("dev1", Kind.TRAIN_RES)


class RecordingTransport:
    """Keeps what is published (connecting and subscribing do nothing); `max_packet_size` as an
    MQTT 5 broker would announce it."""

    def __init__(self, max_packet_size: int | None = None):
        self.client_id = "dev1"
        self.counter = ByteCounter()
        self.incoming = IncomingQueue()
        self.max_packet_size = max_packet_size
        self.published: list[bytes] = []

    def connect(self) -> None: ...
    def close(self) -> None: ...
    def subscribe(self, topic_filter: str, qos: int = 1) -> None: ...

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        self.published.append(bytes(payload))


def update(size: int) -> Envelope:
    return Envelope(Kind.TRAIN_RES, "dev1", groups={"shared": {"w": np.arange(size // 4, dtype=np.float32)}})


def reassembled(frames: list[bytes]) -> bytes:
    return b"".join(bytes(chunk_from_dict(wire.unpack(f)).data) for f in frames)


def test_an_update_under_the_chunk_size_travels_as_one_message():
    # Prepare
    transport = RecordingTransport()
    envelope = update(1 << 20)

    # Execute
    sent = Channel(transport, TOPICS, chunk_size=4 << 20).send(TOPIC, envelope)

    # Assert
    assert transport.published == [wire.encode(envelope)] and sent == len(transport.published[0])


def test_a_larger_one_is_chunked_into_frames_that_reassemble_to_it():
    # Prepare
    transport = RecordingTransport()
    envelope = update(1 << 20)

    # Execute
    sent = Channel(transport, TOPICS, chunk_size=MIN_CHUNK_SIZE * 8).send(TOPIC, envelope)

    # Assert
    frames = transport.published
    assert len(frames) > 1 and all(is_chunk_frame(wire.unpack(f)) for f in frames)
    assert reassembled(frames) == wire.encode(envelope) and sent == sum(len(f) for f in frames)


def test_the_broker_packet_limit_caps_what_travels_whole():
    # Prepare: the chunk size allows one message, the broker (MQTT 5 CONNACK) does not
    limit = 256 << 10
    transport = RecordingTransport(max_packet_size=limit)
    envelope = update(1 << 20)

    # Execute
    Channel(transport, TOPICS, chunk_size=64 << 20).send(TOPIC, envelope)

    # Assert: every packet (payload, topic and MQTT header) fits
    frames = transport.published
    assert len(frames) > 1 and max(len(f) + len(TOPIC) + 16 for f in frames) <= limit
    assert reassembled(frames) == wire.encode(envelope)


def test_retained_messages_must_fit_in_one_message():
    with pytest.raises(ValueError, match="retained"):
        Channel(RecordingTransport(), TOPICS, chunk_size=MIN_CHUNK_SIZE).send(TOPIC, update(1 << 20), retain=True)


def test_release_lets_go_of_the_message_received_last():
    # Prepare
    transport = RecordingTransport()
    channel = Channel(transport, TOPICS)
    transport.incoming.put_message(Incoming(TOPIC, b"x" * 10))
    transport.incoming.get_nowait()

    # Execute
    channel.release()

    # Assert
    assert transport.incoming.held_bytes == 0
