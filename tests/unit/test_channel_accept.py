"""What a Channel accepts and counts, over the loopback broker: whole envelopes out of chunk
frames, bytes and messages by kind and direction, and every rejection (malformed, forged sender,
foreign federation, kind off its topic, over the reassembly budget) counted once by its reason,
while the valid message sent after it still arrives."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edge_sdk import wire
from edge_sdk.channel import Channel
from edge_sdk.loopback import LoopbackBroker
from edge_sdk.protocol import Envelope, Kind, Topics

FED = "unitfed"
WAIT = 10.0  # seconds any single expected message may take


def _connected(broker: LoopbackBroker, client_id: str, *filters: str):
    transport = broker.transport(client_id)
    transport.connect()
    for topic_filter in filters:
        transport.subscribe(topic_filter)
    return transport


def _pair(chunk_size: int = 1 << 20, **receiver_kw):
    """A device-side sender and a coordinator-side receiver of FED's upstream topics."""
    broker = LoopbackBroker()
    topics = Topics(FED)
    receiver = Channel(_connected(broker, "coordinator", topics.all_up(), f"{FED}/#", "edgepfl/#"),
                       topics, **receiver_kw)
    sender = Channel(_connected(broker, "dev001"), topics, chunk_size=chunk_size)
    return broker, topics, sender, receiver


def _sentinel(sender: Channel, topics: Topics) -> Envelope:
    """A valid message sent after a bad one: receiving it proves the bad one was handled."""
    envelope = Envelope(Kind.HELLO, "dev001", metrics={"num_examples": 1})
    sender.send(topics.up("dev001", Kind.HELLO), envelope)
    return envelope



def test_large_envelope_sent_in_128k_chunks_arrives_whole_and_is_counted():
    # Prepare: ~6 MB of float32 in two groups
    chunk_size = 128 << 10
    _, topics, sender, receiver = _pair(chunk_size=chunk_size)
    rng = np.random.default_rng(9)
    arrays = {"a": rng.standard_normal((1000, 1000)).astype(np.float32),
              "b": rng.standard_normal(500_000).astype(np.float32)}
    envelope = Envelope(Kind.TRAIN_RES, "dev001", run_id="r", round=2, groups={"shared": arrays},
                        metrics={"num_examples": 10})
    topic = topics.up("dev001", Kind.TRAIN_RES)
    frames = math.ceil(len(wire.encode(envelope)) / chunk_size)

    # Execute
    sent = sender.send(topic, envelope)
    got = receiver.receive(timeout=WAIT)

    # Assert
    assert frames >= 40
    assert got is not None and got.topic == topic and got.address.client_id == "dev001"
    assert got.envelope.msg_id == envelope.msg_id
    for key, array in arrays.items():
        np.testing.assert_array_equal(got.envelope.groups["shared"][key], array)
    on_wire = sent + frames * len(topic)  # the counters count topic + payload per frame
    assert sender.counter.by_kind()["sent"] == {"train_res": on_wire}
    assert receiver.counter.by_kind()["received"] == {"train_res": on_wire}
    assert receiver.rejections == {} and receiver.duplicates == 0
    assert receiver.receive(timeout=0.0) is None  # exactly one envelope came out of the frames


def test_counters_separate_kinds_and_directions():
    # Prepare
    _, topics, sender, receiver = _pair()
    hello = Envelope(Kind.HELLO, "dev001", metrics={"num_examples": 3})
    result = Envelope(Kind.EVAL_RES, "dev001", metrics={"accuracy": 0.5})

    # Execute
    n_hello = sender.send(topics.up("dev001", Kind.HELLO), hello)
    n_eval = sender.send(topics.up("dev001", Kind.EVAL_RES), result)
    assert receiver.receive(WAIT) is not None and receiver.receive(WAIT) is not None

    # Assert
    t_hello, t_eval = len(topics.up("dev001", Kind.HELLO)), len(topics.up("dev001", Kind.EVAL_RES))
    expected = {"hello": n_hello + t_hello, "eval_res": n_eval + t_eval}
    assert sender.counter.by_kind() == {"sent": expected, "received": {}}
    assert receiver.counter.by_kind()["received"] == expected
    assert receiver.counter.snapshot() == (0, sum(expected.values()))


def test_sender_differing_from_the_topic_id_is_rejected():
    # Prepare: dev001's connection publishes an envelope claiming to be dev002 on dev002's topic
    _, topics, sender, receiver = _pair()
    forged = Envelope(Kind.TRAIN_RES, "dev002", metrics={"num_examples": 1})
    sender.transport.publish(topics.up("dev001", Kind.TRAIN_RES), wire.encode(forged))
    sentinel = _sentinel(sender, topics)

    # Execute
    got = receiver.receive(timeout=WAIT)

    # Assert
    assert got.envelope.msg_id == sentinel.msg_id
    assert receiver.rejections == {"sender_mismatch": 1}


def test_redelivered_identical_payload_is_dropped_as_duplicate():
    # Prepare
    _, topics, sender, receiver = _pair()
    envelope = Envelope(Kind.TRAIN_RES, "dev001", metrics={"num_examples": 1})
    payload = wire.encode(envelope)
    topic = topics.up("dev001", Kind.TRAIN_RES)
    sender.transport.publish(topic, payload)
    sender.transport.publish(topic, payload)  # QoS 1 redelivery
    sentinel = _sentinel(sender, topics)

    # Execute
    first = receiver.receive(timeout=WAIT)
    second = receiver.receive(timeout=WAIT)

    # Assert
    assert first.envelope.msg_id == envelope.msg_id
    assert second.envelope.msg_id == sentinel.msg_id
    assert receiver.duplicates == 1 and receiver.rejections == {}


def test_channel_counters_count_envelopes_bytes_rejections_and_duplicates_by_kind():
    # Prepare: a HELLO and a result, then a redelivery of the result, garbage and a second HELLO
    _, topics, sender, receiver = _pair()
    result = Envelope(Kind.EVAL_RES, "dev001", metrics={"accuracy": 0.5})
    n_hello = sender.send(topics.up("dev001", Kind.HELLO), Envelope(Kind.HELLO, "dev001", metrics={"num_examples": 3}))
    n_result = sender.send(topics.up("dev001", Kind.EVAL_RES), result)
    sender.transport.publish(topics.up("dev001", Kind.EVAL_RES), wire.encode(result))
    sender.transport.publish(topics.up("dev001", Kind.TRAIN_RES), b"\xc1garbage")
    sentinel = _sentinel(sender, topics)
    n_sentinel = len(wire.encode(sentinel))

    # Execute
    assert receiver.receive(WAIT) is not None
    after_first = receiver.counters.snapshot()
    got = [receiver.receive(WAIT) for _ in range(2)]
    total = receiver.counters.snapshot()

    # Assert
    assert [g.envelope.kind for g in got] == [Kind.EVAL_RES, Kind.HELLO] and got[1].size == n_sentinel
    assert sender.counters.snapshot().messages == {"sent": {"eval_res": 1, "hello": 2}, "received": {}}
    assert sender.counters.snapshot().bytes["sent"] == {"eval_res": n_result, "hello": n_hello + n_sentinel}
    assert total.messages["received"] == {"eval_res": 1, "hello": 2}
    assert total.bytes["received"] == {"eval_res": n_result, "hello": n_hello + n_sentinel}
    assert (total.rejections, total.duplicates) == ({"malformed": 1}, 1)
    assert total.accept_seconds > 0 and sender.counters.send_seconds > 0
    between = total - after_first
    assert between.messages["received"] == {"eval_res": 1, "hello": 1}
    assert between.bytes["received"] == {"eval_res": n_result, "hello": n_sentinel}
    assert (between.rejections, between.duplicates) == ({"malformed": 1}, 1)


def test_channel_counters_record_the_reassembly_peak_until_reset():
    # Prepare: an envelope of four 16 KiB frames
    _, topics, sender, receiver = _pair(chunk_size=16 << 10)
    big = Envelope(Kind.TRAIN_RES, "dev001", groups={"g": {"w": np.zeros(14_000, np.float32)}})
    size = len(wire.encode(big))

    # Execute
    sender.send(topics.up("dev001", Kind.TRAIN_RES), big)
    got = receiver.receive(WAIT)
    peaks = (receiver.counters.peak_pending_blobs, receiver.counters.peak_pending_bytes)
    receiver.counters.reset_peaks()

    # Assert: one blob was pending, up to its last frame; the whole envelope counted once
    assert got.size == size and receiver.counters.snapshot().bytes["received"] == {"train_res": size}
    assert sender.counters.snapshot().bytes["sent"] == {"train_res": size}
    assert peaks[0] == 1 and 0 < peaks[1] < size
    assert (receiver.counters.peak_pending_blobs, receiver.counters.peak_pending_bytes) == (0, 0)


@pytest.mark.parametrize("payload", [b"\xc1garbage", b"\x93\x01\x02", b"\x81\xa1a\x01"],
                         ids=["not-msgpack", "list", "map-without-fields"])
def test_garbage_bytes_are_rejected_as_malformed(payload):
    # Prepare
    _, topics, sender, receiver = _pair()
    sender.transport.publish(topics.up("dev001", Kind.TRAIN_RES), payload)
    sentinel = _sentinel(sender, topics)

    # Execute
    got = receiver.receive(timeout=WAIT)

    # Assert
    assert got.envelope.msg_id == sentinel.msg_id
    assert receiver.rejections == {"malformed": 1}


def test_topic_of_another_federation_is_rejected():
    # Prepare: the receiver listens to edgepfl/# and so hears a neighbouring federation
    _, topics, sender, receiver = _pair()
    other = Topics("otherfed")
    sender.transport.publish(other.up("dev001", Kind.HELLO), wire.encode(Envelope(Kind.HELLO, "dev001")))
    sentinel = _sentinel(sender, topics)

    # Execute
    got = receiver.receive(timeout=WAIT)

    # Assert
    assert got.envelope.msg_id == sentinel.msg_id
    assert receiver.rejections == {"bad_topic": 1}


@pytest.mark.parametrize(
    "topic_kind, envelope_kind, direction",
    [(Kind.TRAIN_RES, Kind.EVAL_RES, "up"), (Kind.TRAIN, Kind.TRAIN, "up"), ("reboot", Kind.HELLO, "up")],
    ids=["kind-differs-from-topic", "down-kind-on-up-topic", "unknown-topic-kind"],
)
def test_kind_must_match_the_topic(topic_kind, envelope_kind, direction):
    # Prepare
    _, topics, sender, receiver = _pair()
    segment = topic_kind.value if isinstance(topic_kind, Kind) else topic_kind
    topic = f"edgepfl/{FED}/{direction}/dev001/{segment}"
    sender.transport.publish(topic, wire.encode(Envelope(envelope_kind, "dev001")))
    sentinel = _sentinel(sender, topics)

    # Execute
    got = receiver.receive(timeout=WAIT)

    # Assert
    assert got.envelope.msg_id == sentinel.msg_id
    assert receiver.rejections == {"bad_kind": 1}


def test_a_blob_over_the_reassembly_budget_is_counted_once():
    # Prepare: 4 chunks of 16 KiB, room for 2.5 of them
    chunk = 16 << 10
    _, topics, sender, receiver = _pair(chunk_size=chunk, reassembly_budget=40 << 10)
    big = Envelope(Kind.TRAIN_RES, "dev001", groups={"g": {"w": np.zeros(14_000, np.float32)}})
    sender.send(topics.up("dev001", Kind.TRAIN_RES), big)
    sentinel = _sentinel(sender, topics)

    # Execute
    got = receiver.receive(timeout=WAIT)

    # Assert: one blob was refused, once
    assert got.envelope.msg_id == sentinel.msg_id
    assert receiver.rejections == {"chunk_overflow": 1}


def test_retained_message_larger_than_a_chunk_is_refused():
    _, topics, sender, _ = _pair(chunk_size=16 << 10)
    big = Envelope(Kind.STATUS, "coordinator", groups={"g": {"w": np.zeros(8192, np.float32)}})
    with pytest.raises(ValueError, match="retained"):
        sender.send(topics.broadcast(Kind.STATUS), big, retain=True)

