"""The coordinator's receive path under a flood: what the network thread drops before queueing."""

from __future__ import annotations

import numpy as np

from edge_sdk import wire
from edge_sdk.channel import Channel, SenderBudget
from edge_sdk.chunks import MIN_CHUNK_SIZE
from edge_sdk.protocol import Envelope, Kind, Topics
from edge_sdk.signing import Signer, Verifier
from edge_sdk.transport import Incoming
from test_doubles import Wire

TOPICS = Topics("f")
KEY = bytes(range(32))


def sealed(envelope: Envelope, key: bytes = KEY) -> bytes:
    return b"".join(Signer(key).seal(wire.encode_pieces(envelope)))


def update(sender: str = "dev1", msg_id: str | None = None) -> Envelope:
    envelope = Envelope(Kind.TRAIN_RES, sender, run_id="r", round=1, groups={"shared": {"w": np.ones(8, np.float32)}})
    envelope.msg_id = msg_id or envelope.msg_id
    return envelope


def update_of(floats: int) -> Envelope:
    return Envelope(Kind.TRAIN_RES, "dev1", run_id="r", round=1, groups={"shared": {"w": np.ones(floats, np.float32)}})


def deliver(channel: Channel, topic: str, payload: bytes) -> None:
    channel.transport.incoming.put_message(Incoming(topic, payload))


def test_a_hello_over_its_size_limit_is_dropped_before_it_is_queued():
    # Prepare
    coordinator = Channel(Wire("coordinator"), TOPICS)
    hello = Envelope(Kind.HELLO, "dev1", config={"junk": "x" * 60_000, "more": "y" * 60_000})

    # Execute
    deliver(coordinator, TOPICS.up("dev1", Kind.HELLO), wire.encode(hello))

    # Assert
    assert coordinator.transport.incoming.qsize() == 0
    assert coordinator.rejections == {"too_large": 1}


def test_forged_and_replayed_uploads_are_dropped_before_they_are_queued():
    # Prepare: one real update, then a forgery, random bytes and two replays of the real one
    coordinator = Channel(Wire("coordinator"), TOPICS, verifier=Verifier({"dev1": KEY}))
    topic, real = TOPICS.up("dev1", Kind.TRAIN_RES), sealed(update())

    # Execute
    for payload in (real, sealed(update(), key=bytes(32)), b"\x93\x01\x02\x03", real, real):
        deliver(coordinator, topic, payload)

    # Assert: only the real one waits to be decoded
    assert coordinator.transport.incoming.qsize() == 1
    assert coordinator.rejections == {"bad_signature": 2} and coordinator.duplicates == 2
    received = coordinator.receive(timeout=0.1)
    assert received is not None and received.envelope.sender == "dev1"


def test_a_sender_over_its_budget_is_dropped_until_the_next_round():
    # Prepare: a budget of 3 messages per round
    coordinator = Channel(Wire("coordinator"), TOPICS, sender_budget=SenderBudget(messages=3))
    topic = TOPICS.up("ghost", Kind.TRAIN_RES)

    # Execute: 5 messages in round 1; then a TRAIN broadcast opens round 2, and 1 more message
    for index in range(5):
        deliver(coordinator, topic, wire.encode(update("ghost", msg_id=f"m{index}")))
    queued_in_round_1 = coordinator.transport.incoming.qsize()
    coordinator.send(TOPICS.broadcast(Kind.TRAIN), Envelope(Kind.TRAIN, "coordinator", run_id="r", round=2))
    deliver(coordinator, topic, wire.encode(update("ghost", msg_id="m5")))

    # Assert
    assert queued_in_round_1 == 3
    assert coordinator.rejections == {"over_budget": 2}
    assert coordinator.transport.incoming.qsize() == 4


def test_forgeries_on_a_devices_topic_do_not_spend_its_budget():
    # Prepare: a budget of 2 messages; 10 forgeries on dev1's topic come first
    coordinator = Channel(Wire("coordinator"), TOPICS, verifier=Verifier({"dev1": KEY}),
                          sender_budget=SenderBudget(messages=2))
    topic = TOPICS.up("dev1", Kind.TRAIN_RES)
    for index in range(10):
        deliver(coordinator, topic, sealed(update(msg_id=f"forged{index}"), key=bytes(32)))

    # Execute
    deliver(coordinator, topic, sealed(update(msg_id="real")))

    # Assert
    received = coordinator.receive(timeout=0.1)
    assert received is not None and received.envelope.msg_id == "real"
    assert coordinator.rejections == {"bad_signature": 10}


def test_downstream_messages_keep_their_order_across_topics():
    # Prepare: a device receives two broadcasts, then its own WELCOME
    device = Channel(Wire("dev1"), TOPICS)
    sent = [(TOPICS.broadcast(Kind.STATUS), Kind.STATUS), (TOPICS.broadcast(Kind.TRAIN), Kind.TRAIN),
            (TOPICS.down("dev1", Kind.WELCOME), Kind.WELCOME)]
    for topic, kind in sent:
        deliver(device, topic, wire.encode(Envelope(kind, "coordinator", run_id="r")))

    # Execute
    received = [device.receive(timeout=0.1) for _ in sent]

    # Assert
    assert [r.envelope.kind if r is not None else None for r in received] == [kind for _, kind in sent]


def test_chunk_frames_count_against_the_byte_budget_only():
    # Prepare: a budget of 2 messages; an upload cut into 5 frames
    device_wire = Wire("dev1")
    device = Channel(device_wire, TOPICS, chunk_size=MIN_CHUNK_SIZE)
    device.send(TOPICS.up("dev1", Kind.TRAIN_RES), update_of(5 * MIN_CHUNK_SIZE // 4 - 100))
    coordinator = Channel(Wire("coordinator"), TOPICS, sender_budget=SenderBudget(messages=2))
    for topic, payload in device_wire.published:
        deliver(coordinator, topic, payload)

    # Execute
    received = coordinator.receive(timeout=0.1)

    # Assert
    assert len(device_wire.published) == 5
    assert received is not None and not coordinator.rejections
