"""Per-device message signing: a device's channel seals, the coordinator's verifies before decoding."""

from __future__ import annotations

import json
from typing import cast

import numpy as np
import pytest

from edge_sdk import wire
from edge_sdk.channel import Channel
from edge_sdk.chunks import MIN_CHUNK_SIZE
from edge_sdk.config import ConfigError
from edge_sdk.protocol import Envelope, Kind, Topics
from edge_sdk.settings import BrokerSettings
from edge_sdk.signing import Signer, SigningKeyError, Verifier, device_key, fleet_verifier, new_key, parse_key
from test_doubles import Wire
from edge_sdk.transport import Incoming

TOPICS = Topics("f")
KEYS = {"dev1": bytes(range(32)), "dev2": bytes(range(32, 64))}


def device_channel(client_id: str = "dev1", key: bytes | None = None, chunk_size: int = 1 << 20) -> Channel:
    return Channel(Wire(client_id), TOPICS, chunk_size=chunk_size, signer=Signer(key or KEYS[client_id]))


def sent_by(channel: Channel) -> list[tuple[str, bytes]]:
    """What `channel` published on its Wire."""
    return cast(Wire, channel.transport).published


def coordinator_receives(published: list[tuple[str, bytes]]) -> Channel:
    coordinator = Channel(Wire("coordinator"), TOPICS, verifier=Verifier(KEYS))
    for topic, payload in published:
        coordinator.transport.incoming.put_message(Incoming(topic, payload))
    return coordinator


def update(sender: str = "dev1", size: int = 1000) -> Envelope:
    return Envelope(Kind.TRAIN_RES, sender, run_id="r", round=1,
                    groups={"shared": {"w": np.arange(size, dtype=np.float32)}}, metrics={"num_examples": 5})


def test_a_sealed_update_is_accepted_with_its_arrays():
    # Prepare
    device = device_channel()
    device.send(TOPICS.up("dev1", Kind.TRAIN_RES), update())

    # Execute
    received = coordinator_receives(sent_by(device)).receive(timeout=0.1)

    # Assert
    assert received is not None and received.envelope.sender == "dev1"
    np.testing.assert_array_equal(received.envelope.groups["shared"]["w"], np.arange(1000, dtype=np.float32))


def test_a_chunked_sealed_update_is_verified_once_reassembled():
    # Prepare: an update of 4 chunk frames
    device = device_channel(chunk_size=MIN_CHUNK_SIZE)
    device.send(TOPICS.up("dev1", Kind.TRAIN_RES), update(size=3 * MIN_CHUNK_SIZE // 4))
    coordinator = coordinator_receives(sent_by(device))

    # Execute
    received = coordinator.receive(timeout=0.1)

    # Assert
    assert len(sent_by(device)) == 4
    assert received is not None and received.envelope.groups["shared"]["w"].size == 3 * MIN_CHUNK_SIZE // 4
    assert not coordinator.rejections


@pytest.mark.parametrize("forgery", ["unsigned", "another device's key", "one flipped bit", "unknown device",
                                     "truncated"])
def test_a_forged_upload_is_rejected_as_bad_signature(forgery):
    # Prepare
    topic = TOPICS.up("dev1", Kind.TRAIN_RES)
    if forgery == "unsigned":
        published = [(topic, wire.encode(update()))]
    elif forgery == "another device's key":
        forger = device_channel("dev1", key=KEYS["dev2"])
        forger.send(topic, update())
        published = sent_by(forger)
    elif forgery == "one flipped bit":
        device = device_channel()
        device.send(topic, update())
        payload = bytearray(sent_by(device)[0][1])
        payload[-5] ^= 0x01  # inside the metrics, after the arrays
        published = [(topic, bytes(payload))]
    elif forgery == "truncated":
        device = device_channel()
        device.send(topic, update())
        published = [(topic, sent_by(device)[0][1][:-1])]
    else:
        stranger = device_channel("dev3", key=bytes(32))
        stranger.send(TOPICS.up("dev3", Kind.TRAIN_RES), update("dev3"))
        published = sent_by(stranger)
    coordinator = coordinator_receives(published)

    # Execute
    received = coordinator.receive(timeout=0.05)

    # Assert
    assert received is None
    assert coordinator.rejections == {"bad_signature": 1}


def test_a_device_without_keys_reads_what_it_receives_and_coordinator_messages_are_not_sealed():
    # Prepare: the coordinator (no signer) publishes to a device whose channel holds no verifier
    coordinator = Channel(Wire("coordinator"), TOPICS)
    coordinator.send(TOPICS.down("dev1", Kind.WELCOME), Envelope(Kind.WELCOME, "coordinator", run_id="r"))
    device = Channel(Wire("dev1"), TOPICS)
    device.transport.incoming.put_message(Incoming(*sent_by(coordinator)[0]))

    # Execute
    received = device.receive(timeout=0.1)

    # Assert
    assert received is not None and received.envelope.kind is Kind.WELCOME
    assert b"signed" not in sent_by(coordinator)[0][1]


def test_keys_come_from_the_credentials_file(tmp_path):
    # Prepare
    path = tmp_path / "credentials.json"
    dev1, dev2 = new_key(), new_key()
    path.write_text(json.dumps({"coordinator": {"username": "coordinator", "password": "p"},
                                "devices": {"dev1": {"username": "dev1", "password": "a", "signing_key": dev1},
                                            "dev2": {"username": "dev2", "password": "b", "signing_key": dev2}}}))
    broker = BrokerSettings(credentials=str(path))

    # Execute
    verifier = fleet_verifier(path)
    settings = broker.mqtt_settings("dev2")

    # Assert
    assert verifier is not None and verifier.devices == {"dev1", "dev2"}
    assert device_key(path, "dev1") == bytes.fromhex(dev1)
    assert settings.signing_key == bytes.fromhex(dev2)
    assert broker.mqtt_settings("coordinator").signing_key is None


def test_a_bad_key_is_refused_naming_the_account(tmp_path):
    # Prepare
    path = tmp_path / "credentials.json"
    path.write_text(json.dumps({"devices": {"cam-01": {"username": "cam-01", "password": "a",
                                                       "signing_key": "not hex"}}}))

    # Execute / Assert
    with pytest.raises(SigningKeyError, match="cam-01"):
        parse_key("abcd", "cam-01")
    with pytest.raises(ConfigError, match="cam-01"):
        BrokerSettings(credentials=str(path)).mqtt_settings("cam-01")
