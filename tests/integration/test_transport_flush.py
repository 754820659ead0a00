"""Closing a transport loses nothing it published at QoS 1 (real Mosquitto).

paho holds QoS 1 publications beyond its in-flight window (64) back until earlier ones are
acknowledged; a disconnect right after publishing dropped them. `close` now waits for the
broker's acknowledgements first, so a process that publishes its last messages and exits (the
coordinator's final STATUS) loses none.
"""

from __future__ import annotations

import queue
import time

import pytest

from edge_sdk.transport import FLUSH_SECONDS, MqttSettings, MqttTransport

pytestmark = pytest.mark.integration
MESSAGES = 400
TOPIC = "edgepfl/flush/burst"


def subscribed_receiver(client_id: str, url: str) -> MqttTransport:
    """A transport subscribed to TOPIC, once the broker granted the subscription."""
    receiver = MqttTransport(client_id, MqttSettings(url=url))
    receiver.connect()
    receiver.subscribe(TOPIC)
    deadline = time.monotonic() + 30
    while not receiver.subscriptions_active():
        assert time.monotonic() < deadline, "the broker never granted the subscription"
        receiver.connected.wait(0.05)
    return receiver


def test_messages_published_just_before_close_all_arrive(mosquitto):
    receiver = subscribed_receiver("flush.receiver", mosquitto.url)
    sender = MqttTransport("flush.sender", MqttSettings(url=mosquitto.url))
    sender.connect()
    for index in range(MESSAGES):
        sender.publish(TOPIC, index.to_bytes(4, "big") * 256)
    sender.close()

    received: set[int] = set()
    deadline = time.monotonic() + 60
    while len(received) < MESSAGES and time.monotonic() < deadline:
        try:
            _, payload = receiver.incoming.get(timeout=0.5)
        except queue.Empty:
            continue
        received.add(int.from_bytes(bytes(payload[:4]), "big"))
    receiver.close()
    assert len(received) == MESSAGES, f"{MESSAGES - len(received)} of {MESSAGES} messages lost on close"


def test_a_publication_made_while_disconnected_does_not_break_later_ones_or_the_close(mosquitto):
    # Prepare: a sender whose broker goes away and comes back
    sender = MqttTransport("flush.sender", MqttSettings(url=mosquitto.url))
    sender.connect()
    sender.publish(TOPIC, b"before")
    mosquitto.stop()
    deadline = time.monotonic() + 30
    while sender.connected.is_set():
        assert time.monotonic() < deadline, "the sender never saw the broker go"
        sender.connected.wait(0.05)

    # Execute: a publication while disconnected (paho cannot send it), then the broker back
    sender.publish(TOPIC, b"while away")
    mosquitto.start()
    while not sender.subscriptions_active():
        assert time.monotonic() < deadline + 60, "the sender never reconnected"
        sender.connected.wait(0.05)
    sender.publish(TOPIC, b"after")
    closing = time.monotonic()
    sender.close()

    # Assert: nothing raised, and closing did not wait on what can never be acknowledged
    assert time.monotonic() - closing < FLUSH_SECONDS


def test_large_messages_arrive_whole(mosquitto):
    """Packets over READ_SIZE are written from a view of the packet (paho would copy what is
    left of it for every socket write); each arrives byte for byte, in order."""
    receiver = subscribed_receiver("large.receiver", mosquitto.url)
    sender = MqttTransport("large.sender", MqttSettings(url=mosquitto.url))
    sender.connect()
    payloads = [bytes([index]) * size for index, size in enumerate((3 << 20, 300 << 10, 5 << 20))]
    for payload in payloads:
        sender.publish(TOPIC, payload)
    sender.close()
    try:
        for payload in payloads:
            _, got = receiver.incoming.get(timeout=30)
            assert bytes(got) == payload
    finally:
        receiver.close()
