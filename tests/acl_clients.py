"""MQTT clients on a generated broker setup (`edgepfl broker-config`) for the ACL tests of
test_auth.py and test_shard_acl.py: the `connect` fixture (tests/integration/conftest.py), and
the probes and markers they wait on (test_auth.py says why a marker proves a message dropped)."""

from __future__ import annotations

import queue
import uuid

import pytest

from coordinator.brokers.mosquitto import BrokerSetup
from edge_sdk.transport import Incoming, MqttSettings, MqttTransport

TIMEOUT = 10.0


def settings(setup: BrokerSetup, account: str | None, **overrides) -> MqttSettings:
    values: dict = {"url": setup.url, "connect_timeout": 5.0}
    if account is not None:
        entry = setup.accounts[account]
        values.update(username=entry.username, password=entry.password)
        if setup.ca_file is not None:
            values.update(ca_file=str(setup.ca_file), cert_file=str(entry.cert_file), key_file=str(entry.key_file))
    values.update(overrides)
    return MqttSettings(**values)


@pytest.fixture
def connect():
    """connect(setup, account, **settings) -> a connected MqttTransport, closed after the test."""
    opened: list[MqttTransport] = []

    def open_one(setup: BrokerSetup, account: str | None, **overrides) -> MqttTransport:
        transport = MqttTransport(f"authfed.{account}-{uuid.uuid4().hex[:6]}", settings(setup, account, **overrides))
        transport.connect()
        opened.append(transport)
        return transport

    yield open_one
    for transport in opened:
        transport.close()


def receive_until(transport: MqttTransport, payload: bytes) -> list[Incoming]:
    """Messages received before the one carrying `payload`, leaving out probes (see
    `ensure_subscribed`); fails if `payload` does not come in time."""
    before: list[Incoming] = []
    while True:
        try:
            message = transport.incoming.get(timeout=TIMEOUT)
        except queue.Empty:
            pytest.fail(f"{payload!r} did not arrive within {TIMEOUT} s; got {before}")
        if message.payload == payload:
            return before
        if not message.topic.endswith("/probe"):
            before.append(message)


def ensure_subscribed(receiver: MqttTransport, sender: MqttTransport, topic: str) -> None:
    """Return once `receiver`'s subscriptions are active: a retained probe from `sender` arrives
    live or on subscription, either way after the broker processed the subscription that matches
    `topic` (subscribe to that one last: subscriptions are processed in order)."""
    probe = f"probe-{uuid.uuid4().hex}".encode()
    sender.publish(topic, probe, retain=True)
    receive_until(receiver, probe)
    sender.publish(topic, b"", retain=True)  # clear the retained probe


def marker() -> bytes:
    return f"marker-{uuid.uuid4().hex}".encode()
