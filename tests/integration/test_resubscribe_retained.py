"""A SUBSCRIBE of a filter a client already holds makes the broker send its retained messages again.

What a device's re-subscription after a silence relies on (edge_sdk/session.py, PROTOCOL.md §12):
checked on Mosquitto, on amqtt and on a NATS server with MQTT, each through `MqttTransport`.
"""

from __future__ import annotations

import queue
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.brokers.embedded import EmbeddedBroker, free_port, wait_for_port
from edge_sdk.transport import MqttSettings, MqttTransport
from harness.brokers import Mosquitto
from harness.nats_cluster import nats_binary

pytestmark = pytest.mark.integration
WAIT = 20.0
TOPIC, FILTER = "resub/down/all/status", "resub/down/all/+"


def nats_server(workdir: Path) -> Iterator[str]:
    """One nats-server with JetStream and MQTT on free loopback ports: its MQTT url."""
    workdir.mkdir(parents=True, exist_ok=True)
    port, mqtt_port = free_port(), free_port()
    config = workdir / "nats.conf"
    config.write_text(f"server_name: n1\nlisten: 127.0.0.1:{port}\njetstream {{\n  store_dir: {workdir / 'js'}\n}}\n"
                      f"mqtt {{\n  listen: 127.0.0.1:{mqtt_port}\n}}\n")
    with open(workdir / "nats.log", "w") as log:
        process = subprocess.Popen([nats_binary(), "-c", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        assert wait_for_port("127.0.0.1", mqtt_port, WAIT), (workdir / "nats.log").read_text()[-2000:]
        yield f"mqtt://127.0.0.1:{mqtt_port}"
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture(params=["mosquitto", "amqtt", "nats"])
def broker_url(request, tmp_path) -> Iterator[str]:
    if request.param == "mosquitto":
        broker = Mosquitto(tmp_path / "mosquitto").start()
        yield broker.url
        broker.stop()
    elif request.param == "amqtt":
        with EmbeddedBroker() as embedded:
            yield embedded.url
    else:
        yield from nats_server(tmp_path / "nats")


def next_payload(transport: MqttTransport) -> bytes | None:
    try:
        return bytes(transport.incoming.get(timeout=WAIT).payload)
    except queue.Empty:
        return None


def test_subscribing_again_to_a_held_filter_sends_the_retained_message_again(broker_url):
    # Prepare: a retained message, and a client that subscribed and received it
    publisher = MqttTransport("resub.publisher", MqttSettings(url=broker_url, connect_timeout=WAIT))
    listener = MqttTransport("resub.listener", MqttSettings(url=broker_url, connect_timeout=WAIT))
    publisher.connect()
    listener.connect()
    try:
        publisher.publish(TOPIC, b"finished", retain=True)
        listener.subscribe(FILTER)
        assert next_payload(listener) == b"finished"

        # Execute: the same SUBSCRIBE again
        listener.subscribe(FILTER)

        # Assert: the retained message came again
        assert next_payload(listener) == b"finished"
    finally:
        listener.close()
        publisher.close()
