"""A shard aggregator over the loopback broker, driven by a stand-in coordinator and devices:
it sums exactly, keeps an update that overtakes its ROSTER, notes refusals with their reason and
the refused update's msg_id (an update naming no request included: it is its device's answer),
folds a corrected update after a refusal, and its per-device budgets renew every round."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from coordinator import algorithms
from coordinator.algorithms.base import ServerContext
from coordinator.config.run_config import RunConfig
from coordinator.shards.aggregator import ShardAggregator, parse_shard
from edge_sdk.algorithms.torch_device import SHARED
from edge_sdk.channel import Channel, SenderBudget
from edge_sdk.loopback import LoopbackBroker
from edge_sdk.protocol import COORDINATOR, Envelope, Kind, Topics
from edge_sdk.secagg import stages
from edge_sdk.signing import Signer, Verifier, new_key

FED = "unitshards"
WAIT = 30.0


class Stand:
    """The coordinator's side of the wire, and the devices' uploads, by hand."""

    aggregator: ShardAggregator  # the one the `stand` fixture runs

    def __init__(self, broker: LoopbackBroker, signers: dict[str, Signer] | None = None):
        self.topics = Topics(FED)
        transport = broker.transport(f"{FED}.coordinator")
        transport.connect()
        transport.subscribe(self.topics.all_up())
        self.channel = Channel(transport, self.topics)
        self.devices = {}
        for client_id in ("a", "b", "c"):
            device = broker.transport(f"{FED}.{client_id}")
            device.connect()
            self.devices[client_id] = Channel(device, self.topics, signer=(signers or {}).get(client_id))
        config = RunConfig.of(algorithm="fedavg", dataset="digits", aggregation_dtype="float64")
        self.context = ServerContext(config.model_name, config.task(), 0, 3, 3, config.aggregation)
        self.state = algorithms.load("fedavg")(algorithms.hyperparameters("fedavg", {}), self.context).state
        self.welcome = Envelope(Kind.WELCOME, COORDINATOR, run_id="run1", config={
            "algorithm": "fedavg", "hyper": {},
            "aggregation": {"model": config.model_name, "task": self.context.task.to_plain(), "seed": 0, "rounds": 3,
                            "clients": 3, "rule": dataclasses.asdict(config.aggregation), "max_examples": 1000,
                            "max_update_norm": 0.0, "upload_codec": "fp32"}})

    def send(self, client_id: str, kind: Kind, envelope: Envelope) -> None:
        self.channel.send(self.topics.down(client_id, kind), envelope)

    def roster(self, round_: int, train: Envelope, devices: dict[str, int]) -> None:
        self.send("aggregator-0", Kind.ROSTER, Envelope(Kind.ROSTER, COORDINATOR, run_id="run1", round=round_,
                                                        config={"request": train.msg_id, "devices": devices}))

    def train(self, round_: int) -> Envelope:
        return Envelope(Kind.TRAIN, COORDINATOR, run_id="run1", round=round_, groups=self.state,
                        config={"selected": ["a", "b", "c"]})

    def update(self, client_id: str, train: Envelope, shift: float, examples: int, *,
               names_request: bool = True) -> Envelope:
        """Send `client_id`'s update to `train` (naming it in `in_reply_to` unless told not to)."""
        arrays = {k: (v + np.asarray(shift, v.dtype)) if v.dtype.kind == "f" else v
                  for k, v in self.state[SHARED].items()}
        envelope = Envelope(Kind.TRAIN_RES, client_id, run_id="run1", round=train.round, groups={SHARED: arrays},
                            metrics={"num_examples": examples},
                            config={"in_reply_to": train.msg_id} if names_request else {})
        self.devices[client_id].send(self.topics.shard(0, client_id, Kind.TRAIN_RES), envelope)
        return envelope

    def next_up(self, kind: Kind) -> Envelope:
        while True:
            received = self.channel.receive(WAIT)
            assert received is not None, f"no {kind.value} came"
            if received.envelope.kind is kind:
                return received.envelope

    def notes(self, entries: int) -> list[Envelope]:
        """The NOTEs that come until they name `entries` devices (accepted and refused)."""
        notes = [self.next_up(Kind.NOTE)]
        while sum(len(n.config["accepted"]) + len(n.config["refused"]) for n in notes) < entries:
            notes.append(self.next_up(Kind.NOTE))
        return notes


@pytest.fixture
def stand(request):
    """The stand and a running aggregator; `request.param`, if any: the devices' signing keys."""
    broker, keys = LoopbackBroker(), getattr(request, "param", None)
    stand = Stand(broker, {c: Signer(k) for c, k in keys.items()} if keys else None)
    aggregator = ShardAggregator(0, 2, federation=FED, transport=broker.transport(f"{FED}.aggregator-0"),
                                 verifier=Verifier(keys) if keys else None)
    stop = threading.Event()
    thread = threading.Thread(target=aggregator.run, args=(stop,), daemon=True)
    thread.start()
    stand.aggregator = aggregator
    # retained, so they reach the aggregator whenever it subscribes; its HELLO (the answer to
    # STATUS) comes once every subscription is made, so all that is sent after it arrives
    stand.channel.send(stand.topics.down("aggregator-0", Kind.WELCOME), stand.welcome, retain=True)
    stand.channel.send(stand.topics.broadcast(Kind.STATUS),
                       Envelope(Kind.STATUS, COORDINATOR, run_id="run1", config={"state": "training",
                                                                                 "incarnation": "i1", "epoch": 1}),
                       retain=True)
    stand.next_up(Kind.HELLO)
    yield stand
    stop.set()
    thread.join(timeout=WAIT)


def test_an_update_before_its_roster_is_kept_and_the_partial_is_the_exact_weighted_change(stand):
    # Prepare
    train = stand.train(1)

    # Execute: a's update overtakes the ROSTER; b's comes after it
    stand.send("all", Kind.TRAIN, train)
    stand.update("a", train, 0.5, examples=10)
    stand.roster(1, train, {"a": 10, "b": 30})
    stand.update("b", train, -0.25, examples=99)  # claims more than registered: weighted 30
    partial = stand.next_up(Kind.PARTIAL)

    # Assert: sums = 10 x 0.5 + 30 x (-0.25) = -2.5 per float coordinate, total weight 40
    assert partial.config["folded"] == ["a", "b"] and partial.config["in_reply_to"] == train.msg_id
    assert partial.metrics == {"total_weight": 40.0, "count": 2}
    floats = [k for k, v in stand.state[SHARED].items() if v.dtype.kind == "f"]
    for key in floats:
        assert partial.groups[SHARED][key].dtype == np.float64
        np.testing.assert_allclose(partial.groups[SHARED][key], -2.5, rtol=0, atol=1e-6)


def test_a_refused_update_is_noted_with_its_reason_and_left_out(stand):
    # Prepare
    train = stand.train(1)
    stand.send("all", Kind.TRAIN, train)
    stand.roster(1, train, {"a": 10, "c": 10})

    # Execute
    stand.update("a", train, float("nan"), examples=10)
    stand.update("c", train, 1.0, examples=10)
    notes = stand.notes(2)
    partial = stand.next_up(Kind.PARTIAL)

    # Assert
    assert [entry[:2] for n in notes for entry in n.config["refused"]] == [["a", "non_finite"]]
    assert [c for n in notes for c in n.config["accepted"]] == ["c"]
    assert partial.config["folded"] == ["c"] and partial.metrics == {"total_weight": 10.0, "count": 1}


def test_an_update_naming_no_request_is_its_devices_refused_answer_noted_with_its_msg_id(stand):
    # Prepare
    train = stand.train(1)
    stand.send("all", Kind.TRAIN, train)
    stand.roster(1, train, {"a": 10, "b": 10})

    # Execute: a's update names no request (no `in_reply_to`), b's names the TRAIN
    unnamed = stand.update("a", train, 1.0, examples=10, names_request=False)
    stand.update("b", train, 1.0, examples=10)
    notes = stand.notes(2)
    partial = stand.next_up(Kind.PARTIAL)  # no CLOSE: every device of the roster answered

    # Assert: a's refusal names its update, so the coordinator stops waiting for a and NACKs it
    (refusal,) = [entry for n in notes for entry in n.config["refused"]]
    assert refusal[:2] == ["a", "stale"] and refusal[3] == unnamed.msg_id and "in_reply_to" not in refusal[2]
    assert [c for n in notes for c in n.config["accepted"]] == ["b"]
    assert partial.config["folded"] == ["b"] and partial.metrics == {"total_weight": 10.0, "count": 1}
    assert stand.aggregator.channel.rejections["stale"] == 1


def test_an_unnamed_update_before_its_roster_is_refused_when_the_round_opens_and_a_correction_folds(stand):
    # Prepare
    train = stand.train(1)
    stand.send("all", Kind.TRAIN, train)

    # Execute: a's update names no request and overtakes the ROSTER; told of the refusal (a NACK
    # at the coordinator), a sends a corrected update, a new message; then b answers
    unnamed = stand.update("a", train, 1.0, examples=10, names_request=False)
    stand.roster(1, train, {"a": 10, "b": 30})
    refused = stand.notes(1)
    stand.update("a", train, 0.5, examples=10)
    accepted = stand.notes(1)
    stand.update("b", train, -0.25, examples=30)
    partial = stand.next_up(Kind.PARTIAL)

    # Assert
    assert [entry[::3] for n in refused for entry in n.config["refused"]] == [["a", unnamed.msg_id]]
    assert [c for n in accepted for c in n.config["accepted"]] == ["a"]
    assert partial.config["folded"] == ["a", "b"] and partial.metrics == {"total_weight": 40.0, "count": 2}


def test_an_update_naming_another_request_is_stale_and_no_answer(stand):
    # Prepare
    train = stand.train(1)
    other = stand.train(1)  # another request of the same round (an evaluation's, a resent one's)
    stand.send("all", Kind.TRAIN, train)
    stand.roster(1, train, {"a": 10, "b": 10})

    # Execute
    stand.update("a", other, 1.0, examples=10)
    stand.update("b", train, 1.0, examples=10)
    note = stand.next_up(Kind.NOTE)
    stand.send("aggregator-0", Kind.CLOSE, Envelope(Kind.CLOSE, COORDINATOR, run_id="run1", round=1,
                                                    config={"request": train.msg_id}))
    partial = stand.next_up(Kind.PARTIAL)

    # Assert: a is still awaited (the partial came on CLOSE only), nothing of it was noted
    assert note.config["accepted"] == ["b"] and note.config["refused"] == []
    assert partial.config["folded"] == ["b"]
    assert stand.aggregator.channel.rejections["stale"] == 1


def test_a_close_brings_the_partial_of_what_came_and_budgets_renew_each_round(stand):
    # Prepare: one upload per device per round is all the budget allows
    stand.aggregator.channel.sender_budget = SenderBudget(messages=1, bytes=1 << 30)
    folded = []

    # Execute: three rounds; b never answers, the coordinator closes each round
    for round_ in (1, 2, 3):
        train = stand.train(round_)
        stand.send("all", Kind.TRAIN, train)
        stand.roster(round_, train, {"a": 5, "b": 5})
        stand.update("a", train, 1.0, examples=5)
        stand.next_up(Kind.NOTE)
        stand.send("aggregator-0", Kind.CLOSE, Envelope(Kind.CLOSE, COORDINATOR, run_id="run1", round=round_,
                                                        config={"request": train.msg_id}))
        folded.append(stand.next_up(Kind.PARTIAL).config["folded"])

    # Assert
    assert folded == [["a"], ["a"], ["a"]]
    assert stand.aggregator.channel.rejections.get("over_budget", 0) == 0


@pytest.mark.parametrize("stand", [{"a": bytes.fromhex(new_key())}], indirect=True)
def test_with_the_fleets_keys_an_unsigned_update_is_dropped_unread(stand):
    # Prepare: a signs with its key; c has none enrolled
    train = stand.train(1)
    stand.send("all", Kind.TRAIN, train)
    stand.roster(1, train, {"a": 10, "c": 10})

    # Execute
    stand.update("c", train, 1.0, examples=10)
    stand.update("a", train, 1.0, examples=10)
    note = stand.next_up(Kind.NOTE)

    # Assert
    assert note.config["accepted"] == ["a"] and note.config["refused"] == []
    assert stand.aggregator.channel.rejections["bad_signature"] == 1


@pytest.mark.parametrize("text", ["2/2", "1", "a/b", "-1/2", "1/2/3"])
def test_a_bad_shard_flag_is_refused_by_name(text):
    with pytest.raises(ValueError, match="--shard"):
        parse_shard(text)


def test_under_secure_aggregation_the_partial_is_the_exact_sum_of_the_masked_vectors(stand):
    # Prepare: a secure round's ROSTER gives the masked vectors' length
    train, length = stand.train(1), 5
    stand.send("all", Kind.TRAIN, train)
    stand.send("aggregator-0", Kind.ROSTER, Envelope(Kind.ROSTER, COORDINATOR, run_id="run1", round=1, config={
        "request": train.msg_id, "devices": {"a": 10, "b": 10, "c": 10}, stages.SECURE: {stages.LENGTH: length}}))
    vectors = {"a": np.array([1, 2, 3, 2**32 - 1, 7], dtype=np.uint32),
               "b": np.array([2**31, 5, 0, 3, 2**32 - 2], dtype=np.uint32)}

    # Execute: a and b upload masked vectors; c a plain update, which a secure round cannot take
    for client_id, vector in vectors.items():
        stand.devices[client_id].send(stand.topics.shard(0, client_id, Kind.TRAIN_RES), Envelope(
            Kind.TRAIN_RES, client_id, run_id="run1", round=1, config={"in_reply_to": train.msg_id},
            groups={stages.SECURE: {stages.MASKED: vector.view(np.int32)}}))
    stand.update("c", train, 1.0, examples=10)
    partial = stand.next_up(Kind.PARTIAL)

    # Assert: the sum mod 2^32, still masked, over a and b; c's update refused by name
    assert partial.config["folded"] == ["a", "b"] and partial.metrics == {"total_weight": 0.0, "count": 2}
    assert set(partial.groups) == {stages.SECURE} and set(partial.groups[stages.SECURE]) == {stages.MASKED}
    np.testing.assert_array_equal(partial.groups[stages.SECURE][stages.MASKED].view(np.uint32),
                                  vectors["a"] + vectors["b"])
    assert stand.aggregator.channel.rejections["secagg_invalid"] == 1
