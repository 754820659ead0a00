"""The wire as a real boundary without a broker: Channel over LoopbackBroker, then whole runs.

The first part checks what a Channel accepts and counts. The second runs a Coordinator and
EdgeClients (threads) through `edge_sdk.loopback.LoopbackBroker`: every message is encoded,
chunked when large, routed by topic and decoded, exactly as over MQTT.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import numpy as np
import pytest

from coordinator.run_folder import RunFolder
from edge_sdk import wire
from edge_sdk.algorithms import ALGORITHM_IDS
from edge_sdk.channel import Channel
from edge_sdk.loopback import LoopbackBroker, topic_matches
from edge_sdk.protocol import Envelope, Kind, Topics
from edge_sdk.store import PersonalStore

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


# -- whole runs over the loopback broker ---------------------------------------------------


class BlockingLock:
    """A compute lock that parks its device inside its first training until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __enter__(self):
        self.entered.set()
        self.release.wait(timeout=120)
        return self

    def __exit__(self, *exc) -> bool:
        return False


class Federation:
    """A LoopbackBroker with a Coordinator and EdgeClient threads of one federation."""

    def __init__(self, tmp_path: Path, federation: str):
        self.tmp_path = tmp_path
        self.folder = RunFolder(tmp_path / "run")
        self.topics = Topics(federation)
        self.broker = LoopbackBroker()
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()  # devices take turns to compute: 2 cores are shared

    def config(self, **changes):
        from coordinator.config import RunConfig

        settings = dict(algorithm="fedavg", dataset="digits", clients=3, rounds=2, local_epochs=1, batch_size=64,
                        seed=0, federation=self.topics.federation, out=str(self.folder.path),
                        round_timeout=20.0, registration_timeout=20.0, quorum_grace=15.0, device="cpu")
        settings.update(changes)
        return RunConfig.of(**settings)

    def state_dir(self, client_id: str) -> Path:
        return self.folder.device_state(client_id)

    def start_device(self, index: int, clients: int, compute_lock=None, attack: str | None = None,
                     wrap=None) -> str:
        """Device `index` of `clients` on its digits partition (`wrap(data)` when given)."""
        from edge_sdk.client import EdgeClient
        from edge_sdk.data import load_client_data

        client_id = f"dev{index:03d}"
        will = (self.topics.up(client_id, Kind.OFFLINE), wire.encode(Envelope(Kind.OFFLINE, client_id)))
        data = load_client_data("digits", num_clients=clients, index=index, seed=0)
        data = data if wrap is None else wrap(data)
        client = EdgeClient(client_id, data, federation=self.topics.federation, state_dir=self.state_dir(client_id),
                            device="cpu", compute_lock=compute_lock or self.lock, attack=attack,
                            transport=self.broker.transport(client_id, will=will))
        thread = threading.Thread(target=client.run, args=(self.stop,), name=client_id, daemon=True)
        thread.start()
        self.threads.append(thread)
        return client_id

    def coordinator(self, config):
        from coordinator.server import Coordinator

        transport = self.broker.transport("coordinator")
        transport.connect()
        return Coordinator(config, Channel(transport, self.topics, chunk_size=config.broker.chunk_size))

    def spy(self, kind: Kind) -> Channel:
        """A bystander that decodes (and reassembles) every upstream message of `kind`."""
        return Channel(_connected(self.broker, f"spy-{kind.value}", f"{self.topics.prefix}/up/+/{kind.value}"),
                       self.topics)

    def devices_exit(self, timeout: float = WAIT) -> bool:
        for thread in self.threads:
            thread.join(timeout)
        return not any(t.is_alive() for t in self.threads)

    def shutdown(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(WAIT)


@pytest.fixture
def federation(tmp_path, request, monkeypatch):
    import torch

    monkeypatch.setattr("coordinator.report.plot_curves", lambda path, report: None)  # not under test here

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # devices take turns anyway; more threads only fight over the shared cores
    fed = Federation(tmp_path, f"fed-{request.node.name[5:30].replace('[', '').replace(']', '')}")
    yield fed
    fed.shutdown()
    torch.set_num_threads(threads)


def _drain(channel: Channel) -> list[Envelope]:
    out = []
    while not channel.transport.incoming.empty():
        received = channel.receive(timeout=0.0)
        if received is not None:
            out.append(received.envelope)
    return out


def _metrics_rounds(out: Path) -> list[int]:
    lines = [json.loads(line) for line in RunFolder(out).metrics.read_text().splitlines()]
    return [entry["round"] for entry in lines if entry.get("event") == "round"]


def test_fedavg_runs_two_rounds_and_personal_statistics_never_travel(federation):
    # Prepare
    from edge_sdk.models import build_model, statistics_keys

    config = federation.config()
    coordinator = federation.coordinator(config)
    spy = federation.spy(Kind.TRAIN_RES)
    devices = [federation.start_device(i, 3) for i in range(3)]

    # Execute
    report = coordinator.run()

    # Assert: the run
    assert report["rounds_completed"] == 2
    assert [r["outcome"] for r in report["rounds"]] == ["complete", "complete"]
    assert [r["participants"] for r in report["rounds"]] == [3, 3]
    assert _metrics_rounds(Path(config.run.out)) == [1, 2]
    assert sorted(report["final"]["per_client"]) == devices
    assert report["rejections"] == {}
    assert federation.devices_exit(), "devices should leave on the retained 'finished' status"

    # Assert: what went up, as a bystander decoded it
    results = _drain(spy)
    model = build_model(config.model_name, config.task(), seed=0)
    statistics = statistics_keys(model)
    assert statistics  # the model has BatchNorm statistics to keep home
    assert sorted((e.sender, e.round) for e in results) == sorted((d, r) for d in devices for r in (1, 2))
    for envelope in results:
        keys = {key for group in envelope.groups.values() for key in group}
        assert "head.weight" in keys and "body.0.weight" in keys
        assert not keys & statistics, f"{envelope.sender} sent personal statistics"

    # Assert: each device kept its personal state on its own disk
    for device in devices:
        assert (federation.state_dir(device) / f"personal-{device}.msgpack").is_file()


def test_the_coordinator_publishes_its_rounds_as_events_in_order(federation):
    # Prepare
    from coordinator.events import (DevicesRegistered, RegistrationOpened, RoundAggregated, RoundEnded, RoundEvaluated,
                                    RoundStarted, RunStarted, UpdateAccepted)

    config = federation.config(eval_every=1)
    coordinator = federation.coordinator(config)
    events: list = []
    coordinator.subscribe(events.append)
    ended: list = []
    coordinator.subscribe(ended.append, RoundEnded)
    devices = [federation.start_device(i, 3) for i in range(3)]

    # Execute
    report = coordinator.run()

    # Assert: the order
    kinds = [type(e) for e in events]
    one_round = [RoundStarted, UpdateAccepted, UpdateAccepted, UpdateAccepted, RoundAggregated, RoundEvaluated,
                 RoundEnded]
    assert kinds == [RunStarted, RegistrationOpened, DevicesRegistered, *one_round, *one_round]
    assert ended == [e for e in events if isinstance(e, RoundEnded)]

    # Assert: the content, against the report and the channel's own counts
    assert (events[0].run_id, events[0].after_round, events[0].rounds) == (report["run_id"], 0, 2)
    assert events[1].expected == 3 and (events[2].devices, events[2].trainers) == (3, 3)
    for round_, record in zip((1, 2), report["rounds"]):
        started, *updates, aggregated, evaluated, end = events[3 + 7 * (round_ - 1): 3 + 7 * round_]
        assert started.round == aggregated.round == evaluated.round == end.round == round_
        assert sorted(started.selected) == devices
        assert sorted(u.device for u in updates) == devices and all(u.round == round_ for u in updates)
        assert [u.seconds for u in updates] == sorted(u.seconds for u in updates)
        assert all(u.validation_seconds >= 0 and u.accumulate_seconds >= 0 for u in updates)
        assert sum(u.bytes for u in updates) == end.channel.bytes["received"]["train_res"]
        received = end.channel.messages["received"]  # a device that waited long for WELCOME may say HELLO again
        assert (received["train_res"], received["eval_res"]) == (3, 3)
        assert aggregated.participants == 3 and evaluated.devices == 3
        assert evaluated.accuracy == record["personalized_accuracy"]["mean"]
        assert end.record == record and end.channel.rejections == record["rejections"] == {}


def test_a_run_leaves_its_files_where_its_run_folder_names_them(federation):
    # Prepare
    from coordinator.checkpoint import load as load_checkpoint

    config = federation.config(rounds=1)
    coordinator = federation.coordinator(config)
    for i in range(3):
        federation.start_device(i, 3)

    # Execute
    report = coordinator.run()

    # Assert
    folder = federation.folder
    assert folder.path == Path(config.run.out)
    assert json.loads(folder.report.read_text())["run_id"] == report["run_id"]
    assert load_checkpoint(folder.checkpoint).round == 1
    assert [json.loads(line)["round"] for line in folder.metrics.read_text().splitlines()] == [1]
    assert sorted(p.name for p in folder.state_dir.iterdir()) == ["dev000", "dev001", "dev002"]


def test_a_device_killed_mid_round_is_not_waited_for(federation):
    # Prepare: dev002 parks inside its first training; the others compute normally
    config = federation.config(quorum_grace=15.0, round_timeout=30.0)
    coordinator = federation.coordinator(config)
    parked = BlockingLock()
    federation.start_device(0, 3)
    federation.start_device(1, 3)
    victim = federation.start_device(2, 3, compute_lock=parked)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(coordinator.run()), daemon=True)
    runner.start()
    try:
        assert parked.entered.wait(timeout=30), "round 1 never reached the victim"

        # Execute: the device's process dies; the broker publishes its Last Will
        federation.broker.kill(victim)
        runner.join(timeout=60)
    finally:
        parked.release.set()  # let the parked thread finish; its transport is gone

    # Assert
    assert not runner.is_alive(), "the run did not finish"
    rounds = result["rounds"]
    assert result["rounds_completed"] == 2
    assert (rounds[0]["selected"], rounds[0]["participants"], rounds[0]["outcome"]) == (3, 2, "complete")
    assert (rounds[1]["selected"], rounds[1]["participants"], rounds[1]["outcome"]) == (2, 2, "complete")
    assert victim not in result["final"]["per_client"]
    assert rounds[0]["seconds"] < config.round.quorum_grace  # closed by the Last Will, not by the grace period


def test_a_device_whose_update_is_rejected_is_not_waited_for(federation):
    # Prepare: dev002 uploads NaN every round; the quorum grace is as long as the timeout, so a
    # round closes as COMPLETE (every device answered) or, after 30 s, at the deadline
    config = federation.config(min_clients=2, quorum_grace=30.0, round_timeout=30.0)
    coordinator = federation.coordinator(config)
    federation.start_device(0, 3)
    federation.start_device(1, 3)
    federation.start_device(2, 3, attack="nan")

    # Execute
    report = coordinator.run()

    # Assert: each round closed as soon as the rejected device had answered, and aggregated the other two
    rounds = report["rounds"]
    assert [(r["selected"], r["participants"], r["outcome"]) for r in rounds] == [(3, 2, "complete")] * 2
    assert [r["rejections"] for r in rounds] == [{"non_finite": 1}] * 2
    assert all(r["seconds"] < config.round.round_timeout for r in rounds)
    assert report["final"]["per_client"]["dev000"]["accuracy"] > 0.5, "the NaN upload leaked into the model"


def test_a_device_whose_training_diverges_keeps_its_last_good_personal_state(federation, caplog):
    # Prepare: a learning rate no model survives; LG-FedAvg keeps a personal body on every device
    config = federation.config(algorithm="lg_fedavg", lr=1e30, min_clients=1, quorum_grace=30.0, round_timeout=30.0)
    coordinator = federation.coordinator(config)
    devices = [federation.start_device(i, 3) for i in range(3)]

    # Execute
    with caplog.at_level("WARNING"):
        report = coordinator.run()

    # Assert: every update was rejected without waiting, and no device stored its diverged state
    rounds = report["rounds"]
    assert [(r["outcome"], r["rejections"]) for r in rounds] == [("aborted", {"non_finite": 3})] * 2
    assert all(r["seconds"] < config.round.round_timeout for r in rounds)
    assert "training diverged in round 1" in caplog.text
    for device in devices:
        assert PersonalStore(federation.state_dir(device), device).load() is None, f"{device} saved a diverged state"


@pytest.mark.parametrize("grad_clip_norm", [0.0, 1e-4])
def test_gradient_clipping_announced_in_welcome_keeps_a_too_large_lr_finite(federation, caplog, grad_clip_norm):
    # Prepare: lr 1e4 throws LG-FedAvg's weights to infinity; clipped at 1e-4 a step moves them by about 1
    config = federation.config(algorithm="lg_fedavg", lr=1e4, grad_clip_norm=grad_clip_norm, min_clients=1,
                               quorum_grace=30.0, round_timeout=30.0)
    coordinator = federation.coordinator(config)
    for i in range(3):
        federation.start_device(i, 3)

    # Execute
    with caplog.at_level("WARNING"):
        report = coordinator.run()

    # Assert
    if not grad_clip_norm:
        assert report["rejections"].get("non_finite", 0) > 0 and "training diverged" in caplog.text
        return
    assert [r["outcome"] for r in report["rounds"]] == ["complete"] * 2
    assert report["rejections"] == {} and "training diverged" not in caplog.text
    assert all(0.0 <= c["accuracy"] <= 1.0 for c in report["final"]["per_client"].values())


def sealed_test_split(data):
    """`data` whose test split fails any read (its size stays known, for HELLO)."""
    from edge_sdk.data import ClientData

    class SealedTest(ClientData):
        @property
        def test_x(self):
            raise AssertionError("the test split was read")

        @test_x.setter
        def test_x(self, value):
            self._test_x = value

        @property
        def test_y(self):
            raise AssertionError("the test split was read")

        @test_y.setter
        def test_y(self, value):
            self._test_y = value

        @property
        def num_test(self) -> int:
            return len(self._test_y)

    return SealedTest(data.train_x, data.train_y, data.test_x, data.test_y, data.task, data.domain)


@pytest.mark.parametrize("algorithm", ALGORITHM_IDS)
def test_a_validation_run_trains_and_scores_on_the_training_split_only(federation, algorithm):
    # Prepare: devices whose test split cannot be read; a fifth of each training split held out
    from edge_sdk.data import load_client_data

    config = federation.config(algorithm=algorithm, validation_fraction=0.2)
    coordinator = federation.coordinator(config)
    devices = [federation.start_device(i, 3, wrap=sealed_test_split) for i in range(3)]
    with pytest.raises(AssertionError, match="test split was read"):
        sealed_test_split(load_client_data("digits", num_clients=3, index=0, seed=0)).test_x

    # Execute
    report = coordinator.run()

    # Assert: every device trained and was scored every round, on a fifth of its training data
    assert report["evaluated_on"] == "validation"
    assert [r["participants"] for r in report["rounds"]] == [3, 3]
    assert sorted(report["final"]["per_client"]) == devices
    for index, device in enumerate(devices):
        train = load_client_data("digits", num_clients=3, index=index, seed=0).num_train
        scored = report["final"]["per_client"][device]
        assert 0.15 * train <= scored["num_test"] <= 0.25 * train and 0.0 <= scored["accuracy"] <= 1.0


def test_a_run_whose_only_device_dies_still_finishes(federation):
    # Prepare: one device, parked in round 1 and killed; round 2 has nobody to select
    config = federation.config(clients=1, quorum_grace=15.0, round_timeout=30.0)
    coordinator = federation.coordinator(config)
    parked = BlockingLock()
    victim = federation.start_device(0, 1, compute_lock=parked)
    result: dict = {}
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.update(coordinator.run())
        except BaseException as exc:  # surfaced in the assertions below
            errors.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    try:
        assert parked.entered.wait(timeout=30), "round 1 never reached the device"

        # Execute
        federation.broker.kill(victim)
        runner.join(timeout=60)
    finally:
        parked.release.set()

    # Assert: no round can aggregate, but the run ends with a report instead of a crash
    assert not runner.is_alive(), "the run did not finish"
    assert errors == [], f"the coordinator crashed: {errors!r}"
    assert result["rounds_completed"] == 2
    assert [r["outcome"] for r in result["rounds"]] == ["aborted", "aborted"]
    assert [r["participants"] for r in result["rounds"]] == [0, 0]


def test_resume_continues_the_same_run(federation):
    # Prepare: a finished 2-round run
    first = federation.coordinator(federation.config(rounds=2))
    for i in range(3):
        federation.start_device(i, 3)
    report1 = first.run()
    first.channel.transport.close()
    assert report1["rounds_completed"] == 2 and federation.devices_exit()
    federation.threads.clear()

    # Execute: a new coordinator (and restarted devices) on the same out, extended to 3 rounds
    from coordinator.events import RunStarted

    second = federation.coordinator(federation.config(rounds=3))
    started: list = []
    second.subscribe(started.append, RunStarted)
    for i in range(3):
        federation.start_device(i, 3)
    report2 = second.run()

    # Assert
    played = sum(r["bytes_up"] + r["bytes_down"] for r in report1["rounds"])
    assert started == [RunStarted(first.run_id, 2, 3, played)]
    assert report2["wall_seconds"] > report1["wall_seconds"]  # the time of both incarnations
    assert second.run_id == first.run_id
    assert report2["run_id"] == report1["run_id"]
    assert report2["rounds_completed"] == 3
    assert [r["round"] for r in report2["rounds"]] == [1, 2, 3]
    assert report2["rounds"][2]["outcome"] == "complete"
    assert _metrics_rounds(Path(second.config.run.out)) == [1, 2, 3]
    assert federation.devices_exit()


def _run_in_background(coordinator) -> tuple[threading.Thread, dict, threading.Event]:
    """Start `coordinator.run()` in a thread; the event is set once it listens for devices."""
    from coordinator.events import RegistrationOpened

    listening = threading.Event()
    coordinator.subscribe(lambda event: listening.set(), RegistrationOpened)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(coordinator.run()), daemon=True)
    runner.start()
    return runner, result, listening


def test_a_first_registration_is_one_event(federation):
    # Prepare: the coordinator's STATUS is retained before any device connects
    coordinator = federation.coordinator(federation.config(rounds=1))
    runner, result, listening = _run_in_background(coordinator)
    assert listening.wait(WAIT)

    # Execute
    for i in range(3):
        federation.start_device(i, 3)
    runner.join(60)

    # Assert
    assert not runner.is_alive(), "the run did not finish"
    assert result["events"]["registered"] == 3
    assert result["events"].get("rejoined", 0) == 0


def test_a_weak_device_ends_with_the_reason_when_the_run_releases_nothing(federation, caplog):
    # Prepare: FedAvg without release; one of the three devices is a weak one
    from edge_sdk.data import load_client_data
    from edge_sdk.lite import LiteClient

    coordinator = federation.coordinator(federation.config(rounds=1))
    federation.start_device(0, 3)
    federation.start_device(1, 3)
    will = (federation.topics.up("dev002", Kind.OFFLINE), wire.encode(Envelope(Kind.OFFLINE, "dev002")))
    lite = LiteClient("dev002", load_client_data("digits", num_clients=3, index=2, seed=0),
                      federation=federation.topics.federation, state_dir=federation.state_dir("dev002"),
                      transport=federation.broker.transport("dev002", will=will))
    thread = threading.Thread(target=lite.run, args=(federation.stop,), daemon=True)
    thread.start()
    federation.threads.append(thread)

    # Execute
    with caplog.at_level("ERROR"):
        coordinator.run()
        assert federation.devices_exit()

    # Assert
    assert lite.finished and lite.evaluation is None
    assert "finished without releasing a representation" in lite.missing_model
    assert "--release" in lite.missing_model and lite.missing_model in caplog.text


def test_a_weak_device_in_a_validation_run_fits_and_scores_on_its_training_split_only(federation):
    # Prepare: RepPer with a fifth of each training split held out; dev002 is a weak device; no test split is readable
    from edge_sdk.data import device_seed, load_client_data
    from edge_sdk.lite import LiteClient

    coordinator = federation.coordinator(federation.config(algorithm="repper", rounds=1, validation_fraction=0.2))
    federation.start_device(0, 3, wrap=sealed_test_split)
    federation.start_device(1, 3, wrap=sealed_test_split)
    own = load_client_data("digits", num_clients=3, index=2, seed=0)
    will = (federation.topics.up("dev002", Kind.OFFLINE), wire.encode(Envelope(Kind.OFFLINE, "dev002")))
    lite = LiteClient("dev002", sealed_test_split(own), federation=federation.topics.federation,
                      state_dir=federation.state_dir("dev002"), transport=federation.broker.transport("dev002", will=will))
    thread = threading.Thread(target=lite.run, args=(federation.stop,), daemon=True)
    thread.start()
    federation.threads.append(thread)

    # Execute
    report = coordinator.run()
    assert federation.devices_exit()

    # Assert: the weak device was scored on the same held-out fifth a trainer with its id would hold out
    held_out = own.for_run(0.2, device_seed(0, "dev002"))
    scored = report["final"]["per_client"]["dev002"]
    assert report["evaluated_on"] == "validation" and lite.evaluation is not None
    assert scored["num_test"] == held_out.num_test == len(lite.data.test_y)
    assert 0.15 * own.num_train <= held_out.num_test <= 0.25 * own.num_train
    assert np.array_equal(lite.data.test_x, held_out.test_x)


class Gate:
    """A compute lock that parks its device while closed (it starts closed)."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def __enter__(self):
        self.open.wait(timeout=120)
        return self

    def __exit__(self, *exc) -> bool:
        return False


def test_by_default_the_first_round_waits_for_a_device_slower_than_the_grace(federation):
    # Prepare: no grace after a quorum of one; dev002 computes only once the other two were accepted
    from coordinator.events import UpdateAccepted

    config = federation.config(rounds=1, min_clients=1, quorum_grace=0.0, round_timeout=60.0)
    coordinator = federation.coordinator(config)
    gate = Gate()
    accepted: list = []

    def on_update(event) -> None:
        accepted.append(event.device)
        if len(accepted) == 2:
            gate.open.set()

    coordinator.subscribe(on_update, UpdateAccepted)
    federation.start_device(0, 3)
    federation.start_device(1, 3)
    federation.start_device(2, 3, compute_lock=gate)

    # Execute
    report = coordinator.run()

    # Assert
    first = report["rounds"][0]
    assert (first["selected"], first["participants"], first["late"], first["outcome"]) == (3, 3, 0, "complete")
    assert accepted[-1] == "dev002"


def _slow_third_device(federation, coordinator) -> None:
    """dev002 is parked in every training until its round aggregated, so its update is always
    late; its evaluations are not held up."""
    from coordinator.events import RoundAggregated, RoundEvaluated

    gate = Gate()
    coordinator.subscribe(lambda event: gate.open.set(), RoundAggregated)
    coordinator.subscribe(lambda event: gate.open.clear(), RoundEvaluated)  # before the next TRAIN goes out
    federation.start_device(0, 3)
    federation.start_device(1, 3)
    federation.start_device(2, 3, compute_lock=gate)


def test_a_late_update_is_discarded_and_counted(federation):
    # Prepare
    config = federation.config(rounds=1, min_clients=2, quorum_grace=0.0, patience=0.0, late_updates="discard")
    coordinator = federation.coordinator(config)
    _slow_third_device(federation, coordinator)

    # Execute
    report = coordinator.run()

    # Assert
    record = report["rounds"][0]
    assert (record["selected"], record["participants"], record["late"], record["late_discarded"]) == (3, 2, 1, 1)
    assert report["late_updates"] == {"policy": "discard", "folded": 0, "discarded": 1}
    assert report["rejections"] == {}  # a late update is no rejection
    assert (report["final"]["devices_evaluated"], report["final"]["devices_registered"]) == (3, 3)
    lines = [json.loads(line) for line in federation.folder.metrics.read_text().splitlines()]
    assert [(line["late"], line["late_discarded"]) for line in lines] == [(1, 1)]


def test_a_late_update_is_folded_into_the_next_round(federation):
    # Prepare
    from coordinator.events import RoundAggregated

    config = federation.config(rounds=2, min_clients=2, quorum_grace=0.0, patience=0.0, late_updates="next_round")
    coordinator = federation.coordinator(config)
    aggregated: list = []
    coordinator.subscribe(aggregated.append, RoundAggregated)
    _slow_third_device(federation, coordinator)

    # Execute
    report = coordinator.run()

    # Assert: dev002's round-1 update went into round 2, beside two fresh ones
    first, second = report["rounds"]
    assert (first["participants"], first["late"], first["late_folded"]) == (2, 1, 0)
    assert (second["participants"], second["late"], second["late_folded"]) == (2, 1, 1)
    assert [event.participants for event in aggregated] == [2, 3]
    assert report["late_updates"]["folded"] == 1 and report["rejections"] == {}


def test_delivered_bytes_count_a_broadcast_once_per_online_device(federation):
    # Prepare
    coordinator = federation.coordinator(federation.config(rounds=1))
    for i in range(3):
        federation.start_device(i, 3)

    # Execute
    report = coordinator.run()

    # Assert
    comm = report["communication"]
    published, delivered = comm["by_kind"]["down"], comm["by_kind"]["down_delivered"]
    assert delivered["train"] == 3 * published["train"] and delivered["evaluate"] == 3 * published["evaluate"]
    assert delivered["welcome"] == published["welcome"]  # a device's own topic: one recipient
    assert comm["bytes_down_published"] == comm["bytes_down"] < comm["bytes_down_delivered"]
    assert report["rounds"][0]["bytes_down_delivered"] > report["rounds"][0]["bytes_down"]


def test_a_rerun_of_a_finished_run_changes_nothing(federation):
    # Prepare: a finished 1-round run
    from coordinator.server import finished_report

    config = federation.config(rounds=1)
    first = federation.coordinator(config)
    for i in range(3):
        federation.start_device(i, 3)
    report1 = first.run()
    first.channel.transport.close()
    assert federation.devices_exit()
    written = federation.folder.report.read_bytes()
    metrics = federation.folder.metrics.read_bytes()

    # Execute: the same run again, no device needed
    again = finished_report(config)
    report2 = federation.coordinator(config).run()

    # Assert
    assert again == report2 == json.loads(written)
    assert report2["wall_seconds"] == report1["wall_seconds"]
    assert report2["communication"] == report1["communication"]
    assert federation.folder.report.read_bytes() == written and federation.folder.metrics.read_bytes() == metrics
