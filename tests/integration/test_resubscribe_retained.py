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
def broker(request, tmp_path) -> Iterator[MqttSettings]:
    """A client's settings for the broker: amqtt speaks MQTT 3.1.1 only (an MQTT 5 CONNECT gets no
    answer until the connect timeout), as the embedded broker's runs say too."""
    if request.param == "mosquitto":
        mosquitto = Mosquitto(tmp_path / "mosquitto").start()
        yield MqttSettings(url=mosquitto.url, connect_timeout=WAIT)
        mosquitto.stop()
    elif request.param == "amqtt":
        with EmbeddedBroker() as embedded:
            yield MqttSettings(url=embedded.url, connect_timeout=WAIT, protocol="3.1.1")
    else:
        for url in nats_server(tmp_path / "nats"):
            yield MqttSettings(url=url, connect_timeout=WAIT)


def next_payload(transport: MqttTransport) -> bytes | None:
    try:
        return bytes(transport.incoming.get(timeout=WAIT).payload)
    except queue.Empty:
        return None


def test_subscribing_again_to_a_held_filter_sends_the_retained_message_again(broker):
    # Prepare: a retained message, and a client that subscribed and received it
    publisher = MqttTransport("resub.publisher", broker)
    listener = MqttTransport("resub.listener", broker)
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
