"""Unit tests for how edge_sdk.transport reads from paho without copying (no broker needed)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from paho.mqtt import _packet
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.exception import MalformedPacket
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edge_sdk.transport import READ_SIZE, _Client, decode_publish_in_place


def paho_decode_publish():
    """paho's own decode_publish, from a fresh copy of its module (the imported one is patched)."""
    spec = importlib.util.spec_from_file_location("paho_packet_original", _packet.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.decode_publish


def publish_packet(topic: bytes, payload: bytes, *, qos: int, properties: bytes | None) -> tuple[int, bytearray]:
    """(first header byte, everything after the remaining length) of a PUBLISH."""
    body = bytearray(len(topic).to_bytes(2, "big") + topic)
    if qos:
        body += (4242).to_bytes(2, "big")
    if properties is not None:
        body += properties
    return 0x30 | (qos << 1) | 0x01, body + payload


def user_properties() -> bytes:
    properties = Properties(PacketTypes.PUBLISH)
    properties.UserProperty = ("edgepfl", "1")
    properties.PayloadFormatIndicator = 0
    return properties.pack()


CASES = [(MQTTProtocolVersion.MQTTv311, 0, None), (MQTTProtocolVersion.MQTTv311, 1, None),
         (MQTTProtocolVersion.MQTTv5, 1, b"\x00"), (MQTTProtocolVersion.MQTTv5, 1, user_properties())]


@pytest.mark.parametrize("protocol, qos, properties", CASES, ids=["3.1.1-qos0", "3.1.1-qos1", "5", "5-properties"])
def test_publish_decoding_agrees_with_paho_and_does_not_copy_the_payload(protocol, qos, properties):
    # Prepare
    header, packet = publish_packet(b"edgepfl/f/up/d/train_res", bytes(range(256)) * 64, qos=qos, properties=properties)

    # Execute
    ours = decode_publish_in_place(header, packet, protocol)
    theirs = paho_decode_publish()(header, bytearray(packet), protocol)

    # Assert
    assert (ours.dup, ours.qos, ours.retain, ours.topic, ours.mid) == (theirs.dup, theirs.qos, theirs.retain,
                                                                        theirs.topic, theirs.mid)
    assert ours.payload == theirs.payload
    assert str(ours.properties) == str(theirs.properties)
    assert isinstance(ours.payload, memoryview) and ours.payload.readonly
    assert np.shares_memory(np.frombuffer(ours.payload, np.uint8), np.frombuffer(packet, np.uint8))


def test_paho_decodes_publish_packets_with_ours():
    assert _packet.decode_publish is decode_publish_in_place


@pytest.mark.parametrize("body", [b"", b"\x00", b"\x00\x05ab", b"\x00\x00payload"],
                         ids=["empty", "short", "topic", "no-topic"])
def test_truncated_or_topicless_packets_are_malformed(body):
    with pytest.raises(MalformedPacket):
        decode_publish_in_place(0x30, bytearray(body), MQTTProtocolVersion.MQTTv311)


class RecordingSocket:
    def __init__(self):
        self.asked: list[int] = []

    def recv(self, bufsize: int) -> bytes:
        self.asked.append(bufsize)
        return b"\x00" * min(bufsize, 10)

    def close(self) -> None:
        pass


def test_reads_from_the_socket_are_capped(monkeypatch):
    # Prepare: a client whose socket records what paho asks for
    client, sock = _Client(CallbackAPIVersion.VERSION2, client_id="reads"), RecordingSocket()
    monkeypatch.setattr(client, "_sock", sock)

    # Execute: paho asks for the rest of a large packet at once
    client._sock_recv(8 << 20)
    client._sock_recv(1)

    # Assert
    assert sock.asked == [READ_SIZE, 1]
