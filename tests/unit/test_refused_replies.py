"""What the coordinator does with a message it refuses, over the loopback broker (every message
encoded, routed by topic and decoded as over MQTT; tests/integration/test_nack.py runs the same
on Mosquitto with broker ACLs and signing).

A reply that fails the reply check but answers the open request (it names it, or names no
request while its kind and round are the request's) is its device's answer, refused: the round
does not wait for it. A device registered with the coordinator learns why with a NACK on its own
downstream topic, rate-limited; senders that are not registered, or not authenticated, get none.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from coordinator.fleet.nacks import NackLimiter
from coordinator.run.folder import RunFolder
from edge_sdk import wire
from edge_sdk.channel import Channel
from edge_sdk.client import EdgeClient
from edge_sdk.loopback import LoopbackBroker
from edge_sdk.protocol import NACK_FIELDS, Envelope, Kind, Reason, Topics
from edge_sdk.signing import Signer, Verifier
from loopback_runs import drain, listener

WAIT = 20.0


class OldDocClient(EdgeClient):
    """A trainer built from a protocol document that called a reply's config "ignored": its
    TRAIN_RES and EVAL_RES name no request (no `in_reply_to`)."""

    def send(self, kind: Kind, round_: int = 0, *, request: Envelope | None = None, **fields) -> None:
        super().send(kind, round_, **fields)


class ManualClock:
    """A clock the test moves; starts at 1000 s."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _config(tmp_path: Path, federation: str, **changes):
    from coordinator.config.run_config import RunConfig

    settings: dict[str, Any] = dict(algorithm="fedavg", dataset="digits", clients=3, rounds=1, local_epochs=1,
                                    batch_size=64, seed=0, federation=federation, out=str(tmp_path / "run"),
                                    min_clients=2, round_timeout=60.0, quorum_grace=60.0, registration_timeout=30.0,
                                    device="cpu")
    settings.update(changes)
    return RunConfig.of(**settings)


def test_a_reply_naming_no_request_is_its_devices_refused_answer_and_the_device_learns_why(
        tmp_path, quiet_torch, caplog):
    # Prepare: three trainers; dev002 replies without `in_reply_to`. The round's grace and timeout
    # are 60 s: a round that waited for dev002 would last a minute
    from coordinator.server import Coordinator
    from edge_sdk.data import load_client_data

    federation = "refusals"
    topics, broker, stop, lock = Topics(federation), LoopbackBroker(), threading.Event(), threading.Lock()
    config = _config(tmp_path, federation)
    nacks = listener(broker, "spy-nacks", topics.down("+", Kind.NACK), topics)
    replies = listener(broker, "spy-replies", topics.up("dev002", Kind.TRAIN_RES), topics)
    threads = []
    for index, cls in enumerate([EdgeClient, EdgeClient, OldDocClient]):
        client_id = f"dev{index:03d}"
        client = cls(client_id, load_client_data("digits", num_clients=3, index=index, seed=0), federation=federation,
                     state_dir=RunFolder(tmp_path / "run").device_state(client_id), device="cpu", compute_lock=lock,
                     transport=broker.transport(client_id, will=(topics.up(client_id, Kind.OFFLINE),
                                                                 wire.encode(Envelope(Kind.OFFLINE, client_id)))))
        threads.append(threading.Thread(target=client.run, args=(stop,), daemon=True))
    coordinator_transport = broker.transport("coordinator")
    coordinator_transport.connect()
    coordinator = Coordinator(config, Channel(coordinator_transport, topics))

    # Execute
    for thread in threads:
        thread.start()
    try:
        with caplog.at_level(logging.WARNING, logger="edge_sdk.session"):
            report = coordinator.run()
            for thread in threads:
                thread.join(WAIT)
    finally:
        stop.set()
    assert not any(t.is_alive() for t in threads), "a device did not exit"

    # Assert: the round ended when dev002 had answered, with dev002 refused, not late
    (record,) = report["rounds"]
    assert (record["outcome"], record["participants"], record["refused"], record["late"]) == ("complete", 2, 1, 0)
    assert record["seconds"] < config.round.quorum_grace
    assert report["rejections"] == {"stale": 2}, "its TRAIN_RES and its EVAL_RES"
    assert "dev002" not in report["final"]["per_client"] and len(report["final"]["per_client"]) == 2
    # ... and dev002, only it, got a NACK naming its update, its kind and the reason, nothing else
    update = drain(replies)[0]
    sent = drain(nacks)
    assert {n.kind for n in sent} == {Kind.NACK} and len(sent) == 2
    assert sent[0].config == {"in_reply_to": update.msg_id, "refused_kind": "train_res", "reason": "stale"}
    assert sent[1].config["refused_kind"] == "eval_res" and set(sent[1].config) == set(NACK_FIELDS)
    assert all(not n.groups and not n.metrics for n in sent)
    warnings = [r.getMessage() for r in caplog.records if r.name == "edge_sdk.session" and "refused" in r.getMessage()]
    assert len(warnings) == 2
    assert warnings[0].startswith(f"dev002: the coordinator refused train_res {update.msg_id}: stale")


class Registering:
    """A coordinator waiting for devices (clients=3) on a clock the test moves, and devices'
    channels on the same loopback broker; dev000 and dev001 hold signing keys, the run verifies."""

    KEYS = {"dev000": bytes(range(32)), "dev001": bytes(range(1, 33))}

    def __init__(self, tmp_path: Path):
        from coordinator.server import Coordinator, RegistrationTimeout

        self.topics, self.broker, self.clock = Topics("nackfed"), LoopbackBroker(), ManualClock()
        transport = self.broker.transport("coordinator")
        transport.connect()
        channel = Channel(transport, self.topics, verifier=Verifier(self.KEYS))
        self.coordinator = Coordinator(_config(tmp_path, "nackfed", registration_timeout=600.0), channel,
                                       clock=self.clock)
        self.failure: list[BaseException] = []

        def run() -> None:
            try:
                self.coordinator.run()
            except RegistrationTimeout as exc:
                self.failure.append(exc)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def device(self, client_id: str, key: bytes | None) -> Channel:
        """A device's connection, reading its own downstream topics, sealing with `key`."""
        transport = self.broker.transport(client_id)
        transport.connect()
        transport.subscribe(f"{self.topics.prefix}/down/{client_id}/+")
        return Channel(transport, self.topics, signer=Signer(key) if key is not None else None)

    def send(self, channel: Channel, envelope: Envelope, on: str | None = None) -> Envelope:
        """Publish `envelope` on the upstream topic of `on` (default: the channel's own device)."""
        channel.send(self.topics.up(on or channel.transport.client_id, envelope.kind), envelope)
        return envelope

    def close(self) -> None:
        self.clock.now += 10_000.0  # past the registration timeout: the coordinator gives up
        self.thread.join(WAIT)


@pytest.fixture
def registering(tmp_path):
    run = Registering(tmp_path)
    yield run
    run.close()


def _hello(client_id: str) -> Envelope:
    return Envelope(Kind.HELLO, client_id, metrics={"num_examples": 10}, config={"device_type": "lite"})


def test_only_registered_and_authenticated_senders_get_a_nack(registering):
    # Prepare: dev000 registers; dev001 holds a valid key but has not registered
    dev000 = registering.device("dev000", registering.KEYS["dev000"])
    dev001 = registering.device("dev001", registering.KEYS["dev001"])
    forger = registering.device("forger", bytes(32))
    registering.send(dev000, _hello("dev000"))
    assert dev000.receive(WAIT).envelope.kind is Kind.WELCOME

    # Execute: refused messages on dev000's topic that are not its own (a forged seal, a sender
    # naming another device), one from an unregistered device, then a stale reply of dev000's
    forged = Envelope(Kind.TRAIN_RES, "dev000", run_id=registering.coordinator.run_id, round=1)
    registering.send(forger, forged, on="dev000")  # sealed with another key: bad_signature
    registering.send(dev000, Envelope(Kind.TRAIN_RES, "dev001"))  # dev000 naming dev001: sender_mismatch
    ghost = registering.send(dev001, Envelope(Kind.TRAIN_RES, "dev001", run_id=registering.coordinator.run_id))
    registering.send(dev001, _hello("dev001"))
    stale = registering.send(dev000, Envelope(Kind.EVAL_RES, "dev000", run_id=registering.coordinator.run_id,
                                              round=1, metrics={"accuracy": 0.5}))

    # Assert: dev001's first downstream message is its WELCOME (no NACK for its unregistered
    # reply), and dev000's only NACK names its own stale reply
    assert dev001.receive(WAIT).envelope.kind is Kind.WELCOME
    nack = dev000.receive(WAIT).envelope
    assert nack.kind is Kind.NACK
    assert nack.config == {"in_reply_to": stale.msg_id, "refused_kind": "eval_res", "reason": "stale"}
    assert ghost.msg_id != stale.msg_id and forged.msg_id != stale.msg_id
    assert dev000.receive(0.5) is None
    rejections = registering.coordinator.channel.rejections
    assert (rejections["bad_signature"], rejections["sender_mismatch"], rejections["unknown_device"]) == (1, 1, 1)


def test_a_device_gets_one_nack_per_kind_and_reason_per_second(registering):
    # Prepare
    dev000 = registering.device("dev000", registering.KEYS["dev000"])
    registering.send(dev000, _hello("dev000"))
    assert dev000.receive(WAIT).envelope.kind is Kind.WELCOME
    run_id = registering.coordinator.run_id

    # Execute: three stale replies at the same moment, then a malformed HELLO, then, a second
    # later, one more stale reply
    first = [registering.send(dev000, Envelope(Kind.EVAL_RES, "dev000", run_id=run_id, round=1)) for _ in range(3)]
    bad_hello = registering.send(dev000, Envelope(Kind.HELLO, "dev000", metrics={"num_examples": 0}))
    got = [dev000.receive(WAIT).envelope for _ in range(2)]
    registering.clock.now += 1.0
    later = registering.send(dev000, Envelope(Kind.EVAL_RES, "dev000", run_id=run_id, round=1))
    got.append(dev000.receive(WAIT).envelope)

    # Assert
    assert [(n.config["in_reply_to"], n.config["reason"]) for n in got] == [
        (first[0].msg_id, "stale"), (bad_hello.msg_id, "malformed"), (later.msg_id, "stale")]
    assert dev000.receive(0.5) is None
    assert registering.coordinator.channel.rejections["stale"] == 4


def test_the_nack_limiter_allows_one_per_device_kind_and_reason_per_interval():
    clock = ManualClock()
    limiter = NackLimiter(clock, interval=1.0)

    assert limiter.allow("a", Kind.EVAL_RES, Reason.STALE) and not limiter.allow("a", Kind.EVAL_RES, Reason.STALE)
    assert limiter.allow("a", Kind.EVAL_RES, Reason.MALFORMED) and limiter.allow("b", Kind.EVAL_RES, Reason.STALE)
    assert limiter.allow("a", Kind.TRAIN_RES, Reason.STALE)
    clock.now += 0.999
    assert not limiter.allow("a", Kind.EVAL_RES, Reason.STALE)
    clock.now += 0.001
    assert limiter.allow("a", Kind.EVAL_RES, Reason.STALE)


@pytest.mark.parametrize("shards", [0, 2])
def test_the_broker_rules_let_the_coordinator_write_a_nack_and_only_its_device_read_it(shards):
    from coordinator.brokers.mosquitto import topic_rules
    from edge_sdk.loopback import topic_matches

    topic = Topics("F").down("dev000", Kind.NACK)
    coordinator_writes, _ = topic_rules("F", "coordinator", shards)
    own_reads = topic_rules("F", "dev000", shards)[1]
    other_reads = topic_rules("F", "dev001", shards)[1]

    assert any(topic_matches(rule, topic) for rule in coordinator_writes)
    assert any(topic_matches(rule, topic) for rule in own_reads)
    assert not any(topic_matches(rule, topic) for rule in other_reads)
