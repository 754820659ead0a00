"""A simulated device going offline and coming back (`MqttTransport.drop_connection`,
`reconnect`) over real Mosquitto: the broker publishes its Last Will, what it publishes while
offline is dropped and counted, and the new connection receives again."""

from __future__ import annotations

import time

import pytest

from edge_sdk.transport import MqttSettings, MqttTransport

pytestmark = pytest.mark.integration
WILL = "edgepfl/avail/up/dev001/offline"
DOWN = "edgepfl/avail/down/dev001/train"
UP = "edgepfl/avail/up/dev001/train_res"
WAIT = 30.0


def _subscribed(transport: MqttTransport, *filters: str) -> MqttTransport:
    transport.connect()
    for topic_filter in filters:
        transport.subscribe(topic_filter)
    deadline = time.monotonic() + WAIT
    while not transport.subscriptions_active():
        assert time.monotonic() < deadline, "the broker never granted the subscriptions"
        transport.connected.wait(0.05)
    return transport


def _next(transport: MqttTransport) -> tuple[str, bytes]:
    topic, payload = transport.incoming.get(timeout=WAIT)
    return topic, bytes(payload)


def test_a_dropped_connection_sends_the_will_loses_what_is_published_and_comes_back(mosquitto):
    # Prepare: a watcher of the device's will and uploads; the device listens on its own topic
    watcher = _subscribed(MqttTransport("avail.watcher", MqttSettings(url=mosquitto.url)), WILL, UP)
    device = _subscribed(MqttTransport("dev001", MqttSettings(url=mosquitto.url), will=(WILL, b"gone")), DOWN)

    # Execute: offline, an upload meanwhile, then back
    device.drop_connection()
    will = _next(watcher)
    device.publish(UP, b"while offline")
    device.reconnect()
    deadline = time.monotonic() + WAIT
    while not device.subscriptions_active():
        assert time.monotonic() < deadline, "the new connection's subscriptions were never granted"
        device.connected.wait(0.05)
    device.publish(UP, b"back")
    watcher.publish(DOWN, b"train")

    # Assert: the will, then only the upload made once back; the device receives again
    assert will == (WILL, b"gone")
    assert _next(watcher) == (UP, b"back")
    assert device.dropped_offline == 1 and device.connections == 2
    assert _next(device) == (DOWN, b"train")
    device.close()
    watcher.close()
