"""The loopback broker, the in-memory MQTT of the unit tests: topic filters, Last Will on a
kill (once, and never on a clean close), retained messages and their clearing."""

from __future__ import annotations

from edge_sdk import wire
from edge_sdk.loopback import LoopbackBroker, topic_matches
from edge_sdk.protocol import Envelope, Kind, Topics

FED = "unitfed"


def _connected(broker: LoopbackBroker, client_id: str, *filters: str):
    transport = broker.transport(client_id)
    transport.connect()
    for topic_filter in filters:
        transport.subscribe(topic_filter)
    return transport



def test_topic_matching():
    assert topic_matches("a/+/c", "a/b/c") and topic_matches("a/#", "a/b/c") and topic_matches("a/b", "a/b")
    assert not topic_matches("a/+", "a/b/c") and not topic_matches("a/b/c", "a/b") and not topic_matches("a/x", "a/b")


def test_kill_publishes_the_last_will_once_and_the_dead_client_is_silent():
    # Prepare
    broker = LoopbackBroker()
    topics = Topics(FED)
    listener = _connected(broker, "coordinator", topics.all_up())
    will = (topics.up("dev001", Kind.OFFLINE), wire.encode(Envelope(Kind.OFFLINE, "dev001")))
    device = broker.transport("dev001", will=will)
    device.connect()
    device.subscribe(topics.broadcast(Kind.TRAIN))

    # Execute
    broker.kill("dev001")
    broker.kill("dev001")  # already gone: no second will
    try:
        device.publish(topics.up("dev001", Kind.TRAIN_RES), b"late reply from a dead process")
    except ConnectionError:
        pass  # refusing to publish is as good as dropping it
    _connected(broker, "coordinator2").publish(topics.broadcast(Kind.TRAIN), b"x")

    # Assert
    heard = []
    while not listener.incoming.empty():
        heard.append(listener.incoming.get_nowait())
    assert heard == [will]
    assert device.incoming.empty()  # nothing is delivered to a dead client
    assert not device.connected.is_set()


def test_a_cleanly_closed_client_sends_no_will():
    # Prepare
    broker = LoopbackBroker()
    topics = Topics(FED)
    listener = _connected(broker, "coordinator", topics.all_up())
    device = broker.transport("dev001", will=(topics.up("dev001", Kind.OFFLINE), b"will"))
    device.connect()

    # Execute
    device.close()

    # Assert
    assert listener.incoming.empty()


def test_retained_message_reaches_a_later_subscriber_and_can_be_cleared():
    # Prepare
    broker = LoopbackBroker()
    topic = Topics(FED).broadcast(Kind.STATUS)
    _connected(broker, "coordinator").publish(topic, b"state", retain=True)

    # Execute
    late = _connected(broker, "late", topic)
    _connected(broker, "coordinator2").publish(topic, b"", retain=True)  # clears the retained message
    later = _connected(broker, "later", topic)

    # Assert
    assert late.incoming.get_nowait() == (topic, b"state")
    assert late.incoming.get_nowait() == (topic, b"")  # the clearing publish itself is routed
    assert later.incoming.empty()

