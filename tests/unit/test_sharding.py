"""Sharded aggregation's pieces without a broker: partial sums combine into the mean, shard
assignment, the checks on a PARTIAL, how the coordinator reads a NOTE's refusals, refusals of
what cannot be sharded, shard topics."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.aggregation.averaging import PartialSum, WeightedMean
from coordinator.aggregation.validation import UpdateLimits
from coordinator.algorithms import hyperparameters, load
from coordinator.algorithms.base import ServerContext
from coordinator.config.run_config import RunConfig
from coordinator.fleet.devices import DeviceRegistry
from coordinator.fleet.nacks import NackLimiter
from coordinator.fleet.outbox import Outbox, RunPosition
from coordinator.rounds.collector import RoundCollector
from coordinator.run.ledger import Ledger
from coordinator.server import Coordinator
from coordinator.shards.coordinator_side import ShardedRounds
from coordinator.shards.sharding import ShardRound, check_partial, check_shardable, shard_of
from edge_sdk import wire
from edge_sdk.channel import Channel
from edge_sdk.config import ConfigError
from edge_sdk.params import ArraySpec
from edge_sdk.protocol import Envelope, Kind, ProtocolError, Reason, Topics, ValidationError, shard_of_aggregator
from test_doubles import Wire

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = {"w": np.array([1.0, 2.0], np.float32)}
SPEC: dict[str, ArraySpec] = {"shared": {"w": ((2,), "float64")}}


def _partial(updates, dtype="float64") -> PartialSum:
    mean = WeightedMean(REFERENCE, dtype)
    for arrays, weight in updates:
        mean.add(arrays, weight)
    return mean.partial()


def test_two_partials_combine_to_the_hand_checked_mean():
    # Prepare: shard 0 has (3, 6) at weight 1, shard 1 has (5, 10) at weight 3; reference (1, 2)
    first = _partial([({"w": np.array([3.0, 6.0], np.float32)}, 1.0)])
    second = _partial([({"w": np.array([5.0, 10.0], np.float32)}, 3.0)])

    # Execute
    mean = WeightedMean(REFERENCE, "float64")
    mean.add_partial(first, {"w": np.dtype(np.float32)})
    mean.add_partial(second, {"w": np.dtype(np.float32)})
    result = mean.result()

    # Assert: sums (2, 4) and (12, 24); (1, 2) + (14, 28) / 4 = (4.5, 9), as float32
    np.testing.assert_array_equal(first.sums["w"], [2.0, 4.0])
    np.testing.assert_array_equal(second.sums["w"], [12.0, 24.0])
    assert (mean.total_weight, mean.count) == (4.0, 2)
    assert result["w"].dtype == np.float32
    np.testing.assert_array_equal(result["w"], np.array([4.5, 9.0], np.float32))


def test_partials_of_a_split_equal_the_unsplit_mean_bit_for_bit_in_float64():
    # Prepare
    rng = np.random.default_rng(7)
    updates = [({"w": rng.standard_normal(2).astype(np.float32)}, float(rng.integers(1, 60))) for _ in range(40)]
    whole = WeightedMean(REFERENCE, "float64")
    for arrays, weight in updates:
        whole.add(arrays, weight)

    # Execute
    combined = WeightedMean(REFERENCE, "float64")
    for shard in (updates[::2], updates[1::2]):
        combined.add_partial(_partial(shard), {"w": np.dtype(np.float32)})

    # Assert
    assert np.array_equal(combined.result()["w"], whole.result()["w"])


def test_an_empty_partial_changes_nothing_and_a_spent_mean_refuses_more():
    # Prepare
    mean = WeightedMean(REFERENCE, "float64")
    mean.add_partial(PartialSum({}, 0.0, 0), {})
    mean.add_partial(_partial([({"w": np.array([3.0, 2.0], np.float32)}, 2.0)]), {"w": np.dtype(np.float32)})

    # Execute
    result = mean.result()

    # Assert
    np.testing.assert_array_equal(result["w"], [3.0, 2.0])
    with pytest.raises(ValueError, match="already taken"):
        mean.add_partial(PartialSum({"w": np.zeros(2)}, 1.0, 1), {"w": np.dtype(np.float32)})


def test_shard_of_is_stable_and_spreads_devices():
    # Execute
    shards = [shard_of(f"device{i}", 2) for i in range(100)]

    # Assert: the same every time; both shards used
    assert shards == [shard_of(f"device{i}", 2) for i in range(100)]
    assert 30 <= sum(shards) <= 70


def _partial_envelope(**changes) -> Envelope:
    fields: dict[str, Any] = {"groups": {"shared": {"w": np.array([2.0, 4.0])}},
                              "metrics": {"total_weight": 5.0, "count": 2},
                              "config": {"shard": 0, "folded": ["a", "b"], "in_reply_to": "r"}}
    for key, value in changes.items():
        fields[key] = {**fields[key], **value} if isinstance(value, dict) and key != "groups" else value
    return Envelope(Kind.PARTIAL, "aggregator-0", **fields)


def test_a_valid_partial_is_accepted_with_its_weight():
    # Execute
    partial = check_partial(_partial_envelope(), 0, {"a": 2, "b": 3, "c": 9}, SPEC, 1000)

    # Assert
    assert partial.folded == ["a", "b"]
    assert partial.sums["shared"].total_weight == 5.0 and partial.sums["shared"].count == 2


@pytest.mark.parametrize("changes, reason", [
    ({"groups": {"shared": {"w": np.array([2.0, 4.0, 1.0])}}}, Reason.BAD_SHAPE),
    ({"groups": {"shared": {"w": np.array([2.0, np.nan])}}}, Reason.NON_FINITE),
    ({"groups": {"shared": {"w": np.array([2.0, 4.0], np.float32)}}}, Reason.BAD_DTYPE),
    ({"groups": {"other": {"w": np.array([2.0, 4.0])}}}, Reason.UNEXPECTED_ARRAYS),
    ({"config": {"folded": ["a", "z"]}}, Reason.NOT_SELECTED),
    ({"config": {"shard": 1}}, Reason.SENDER_MISMATCH),
    ({"metrics": {"total_weight": 6.0}}, Reason.MALFORMED),  # more than a's 2 + b's 3 examples
    ({"metrics": {"total_weight": 0.0}}, Reason.MALFORMED),
    ({"metrics": {"count": 3}}, Reason.MALFORMED),
])
def test_a_forged_partial_is_refused_with_its_reason(changes, reason):
    with pytest.raises(ValidationError) as caught:
        check_partial(_partial_envelope(**changes), 0, {"a": 2, "b": 3}, SPEC, 1000)
    assert caught.value.reason is reason


def test_a_lost_shard_turns_its_folded_updates_into_missing_devices():
    # Prepare
    collector = RoundCollector(1, frozenset({"a", "b", "c"}), min_replies=2, deadline=100.0, grace=0.0)
    sharded = ShardRound("r", {0: {"a": 1, "b": 1}, 1: {"c": 1}}, collector)
    sharded.folded(0, "a", "m1", 0.0)
    sharded.folded(1, "c", "m2", 0.0)

    # Execute
    lost = sharded.lose(0, "its aggregator went offline")

    # Assert
    assert lost == 1 and sharded.lost_updates == 1
    assert set(collector.replied) == {"c"} and collector.offline == {"a", "b"}
    assert not collector.enough and sharded.open_shards == [1]
    assert sharded.lose(0, "again") == 0


def test_a_notes_refusals_end_the_devices_wait_and_a_named_update_gets_its_nack():
    # Prepare: one shard, devices a, b, c selected; a NOTE refusing a (naming its update),
    # b (an older aggregator's entry: no msg_id), a malformed entry, and a's refusal again
    transport, sharding, collector, sharded = _one_shard_round()
    refused = [["a", "stale", "names no request", "update-a"], ["b", "non_finite", "nan"], ["c"],
               ["a", "stale", "names no request", "update-a"]]

    # Execute
    sharding.on_message(Envelope(Kind.NOTE, "aggregator-0", run_id="run1", round=1,
                                 config={"in_reply_to": "train1", "shard": 0, "accepted": [], "refused": refused}))

    # Assert: a and b are no longer waited for, c is; a (only) is told why, naming its update
    assert sharded.collector is collector and collector.waiting == frozenset({"c"})
    assert collector.refused["a"] == "update-a" and "b" in collector.refused
    nacks = {topic.split("/")[3]: wire.decode(payload).config for topic, payload in transport.published}
    assert nacks == {"a": {"in_reply_to": "update-a", "refused_kind": "train_res", "reason": "stale"},
                     "aggregator-0": {"in_reply_to": nacks["aggregator-0"]["in_reply_to"], "refused_kind": "note",
                                      "reason": "malformed"}}
    channel = sharding.outbox.channel
    assert dict(channel.rejections) == {"stale": 1, "non_finite": 1, "malformed": 1}
    assert channel.counters.duplicates == 1


def _one_shard_round() -> tuple[Wire, ShardedRounds, RoundCollector, ShardRound]:
    """One shard (aggregator-0), devices a, b and c selected in round 1 of run run1, whose TRAIN
    has msg_id train1; the ROSTER is sent, and the wire's record of it cleared."""
    transport, position = Wire("coordinator"), RunPosition("run1")
    channel = Channel(transport, Topics("fed"))
    registry = DeviceRegistry()
    registry.register("aggregator-0", "aggregator", 0, {})
    for client_id in ("a", "b", "c"):
        registry.register(client_id, "trainer", 10, {})
    outbox = Outbox(channel, registry, Ledger(channel), position, NackLimiter(lambda: 0.0))
    config = RunConfig.of(algorithm="fedavg", dataset="digits", shards=1)
    algorithm = load("fedavg")(hyperparameters("fedavg", {}),
                               ServerContext(config.model_name, config.task(), 0, 1, 3, config.aggregation))
    sharding = ShardedRounds(1, algorithm, UpdateLimits(1000, 0.0), registry, outbox, Ledger(channel), lambda: 0.0)
    collector = RoundCollector(1, frozenset({"a", "b", "c"}), min_replies=1, deadline=100.0, grace=0.0)
    sharded = sharding.open(1, ["a", "b", "c"], Envelope(Kind.TRAIN, "coordinator", run_id="run1", round=1,
                                                         msg_id="train1"), collector)
    transport.published.clear()
    return transport, sharding, collector, sharded


def test_an_aggregator_registering_again_gets_its_roster_and_the_train_and_its_silent_devices_the_train():
    # Prepare: a's update was noted folded; b's and c's not yet
    transport, sharding, collector, sharded = _one_shard_round()
    sharded.folded(0, "a", "update-a", 0.0)

    # Execute
    sharding.rejoined("aggregator-0")
    sharding.rejoined("b")  # a device is none of the shards' business

    # Assert: the same ROSTER and TRAIN (same msg_ids) to the aggregator, the TRAIN to b and c only
    sent = [(topic.split("/")[3], wire.decode(payload)) for topic, payload in transport.published]
    assert [(who, e.kind, e.msg_id) for who, e in sent[:2]] == [("aggregator-0", Kind.ROSTER, sent[0][1].msg_id),
                                                                ("aggregator-0", Kind.TRAIN, "train1")]
    assert sent[0][1].config == {"request": "train1", "devices": {"a": 10, "b": 10, "c": 10}}
    assert sorted((who, e.kind, e.msg_id) for who, e in sent[2:]) == [("b", Kind.TRAIN, "train1"),
                                                                      ("c", Kind.TRAIN, "train1")]
    assert collector.waiting == frozenset({"b", "c"})


def test_an_aggregator_registering_again_after_the_close_gets_the_close_again_and_nothing_once_lost():
    # Prepare: while the closed round waits for the partial, the aggregator registers again;
    # then its shard is lost (the serve callback stands in for the messages that come)
    transport, sharding, _, sharded = _one_shard_round()

    def serve(timeout: float) -> None:
        sharding.rejoined("aggregator-0")
        sharding.lose(0, "stands in for the timeout", sharded)

    # Execute
    sharding.gather(sharded, 5.0, serve)
    sharding.rejoined("aggregator-0")

    # Assert: the CLOSE, then the ROSTER, the TRAIN and the CLOSE again; nothing once the shard is lost
    kinds = [wire.decode(payload).kind for _, payload in transport.published]
    assert kinds == [Kind.CLOSE, Kind.ROSTER, Kind.TRAIN, Kind.CLOSE]


@pytest.mark.parametrize("algorithm, values, match", [
    ("dc_pfl", {}, "dc_pfl cannot be aggregated in shards"),
    ("local", {}, "local cannot be aggregated in shards"),
    ("fedavg", {"aggregation": "median"}, "aggregation median needs every update"),
    ("fedavg", {"aggregation": "trimmed_mean"}, "aggregation trimmed_mean needs every update"),
])
def test_what_cannot_be_sharded_is_refused_by_name(algorithm, values, match):
    config = RunConfig.of(algorithm=algorithm, shards=2, **values)
    with pytest.raises(ConfigError, match=match):
        check_shardable(load(algorithm), config.aggregation.rule, config.round.shards)


def test_next_round_late_updates_are_refused_when_sharded():
    with pytest.raises(ConfigError, match="late_updates must be discard when sharded"):
        RunConfig.of(shards=2, late_updates="next_round")


def test_the_part_sharing_family_shards():
    for algorithm in ("fedavg", "fedper", "fedrep", "lg_fedavg", "fedprox", "fedavg_ft", "repper", "dualfed",
                      "cd2_pfed", "fedios"):
        check_shardable(load(algorithm), "mean", 2)


def test_shard_topics_parse_as_upstream_updates_of_their_sender():
    # Prepare
    topics = Topics("fed")

    # Execute
    address = topics.parse(topics.shard(3, "dev7", Kind.TRAIN_RES))

    # Assert
    assert topics.shard(3, "dev7", Kind.TRAIN_RES) == "edgepfl/fed/shard-3/dev7/train_res"
    assert (address.direction, address.client_id, address.kind, address.shard) == ("up", "dev7", Kind.TRAIN_RES, 3)
    with pytest.raises(ProtocolError) as caught:
        topics.parse("edgepfl/fed/shard-3/dev7/hello")
    assert caught.value.reason is Reason.BAD_KIND
    with pytest.raises(ProtocolError):
        topics.parse("edgepfl/fed/shard-x/dev7/train_res")
    assert shard_of_aggregator("aggregator-4") == 4 and shard_of_aggregator("aggregator-04") is None
    assert shard_of_aggregator("dev1") is None


def test_the_coordinator_refuses_an_unshardable_run_before_anything_starts(tmp_path):
    # Prepare
    config = RunConfig.of(algorithm="dc_pfl", shards=2, out=str(tmp_path))

    # Execute / Assert
    with pytest.raises(ConfigError, match="algorithm dc_pfl cannot be aggregated in shards"):
        Coordinator(config, Channel(Wire("coordinator"), Topics("fed")))
    assert not (tmp_path / "checkpoint.msgpack").exists()


@pytest.mark.parametrize("flags, named", [
    (["--algorithm", "local"], "algorithm local cannot be aggregated in shards"),
    (["--aggregation", "trimmed_mean"], "aggregation trimmed_mean needs every update"),
    (["--late-updates", "next_round"], "late_updates must be discard when sharded"),
])
def test_the_coordinator_command_refuses_an_unshardable_run_before_connecting(tmp_path, flags, named):
    # Execute: a broker nobody listens on; connecting would fail with exit code 1, not 2
    result = subprocess.run([sys.executable, "-m", "coordinator.cli", "coordinator", "--shards", "2", *flags,
                             "--broker", "mqtt://127.0.0.1:9", "--connect-timeout", "0", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})

    # Assert
    assert result.returncode == 2, result.stderr
    assert named in result.stderr and "Traceback" not in result.stderr
