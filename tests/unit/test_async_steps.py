"""Buffered asynchronous aggregation's bookkeeping and arithmetic (coordinator/rounds/async_steps.py):
FedBuff's staleness weight, updates rebased on the current state, the in-flight devices, and
which algorithms and settings may run asynchronously."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from builtin_tasks import DIGITS
from coordinator import algorithms
from coordinator.algorithms.base import ServerContext
from coordinator.config.run_config import RunConfig
from coordinator.rounds.async_steps import AsyncSteps, check_async_run, rebase, staleness_factor
from edge_sdk.algorithms import ALGORITHM_IDS
from edge_sdk.algorithms.torch_device import SHARED
from edge_sdk.config import ConfigError
from edge_sdk.protocol import COORDINATOR, ArrayGroup, Envelope, Kind

ASYNCHRONOUS = {"fedavg", "fedavg_ft", "fedprox", "fedper", "fedrep", "lg_fedavg", "repper", "dualfed", "fedios",
                "ditto", "fedbn", "fedbabu", "apfl", "fedrod", "fedala"}
"""The algorithms whose server averages new values of what it sent (README's async column)."""


def train(msg_id: str, groups: dict | None = None) -> Envelope:
    """A TRAIN of message id `msg_id` carrying `groups` (by default one empty group)."""
    return Envelope(Kind.TRAIN, COORDINATOR, msg_id=msg_id, groups={"g": {}} if groups is None else groups)


def test_fedbuffs_polynomial_staleness_weight():
    assert staleness_factor(0, 0.5) == 1.0
    assert staleness_factor(3, 0.5) == 0.5
    assert staleness_factor(3, 1.0) == 0.25
    assert staleness_factor(7, 0.0) == 1.0


def test_an_update_is_applied_as_its_change_scaled_on_the_current_state():
    sent: dict[str, ArrayGroup] = {"g": {"w": np.array([1.0, 2.0], np.float32), "steps": np.array(5, np.int64)}}
    current: dict[str, ArrayGroup] = {"g": {"w": np.array([3.0, 3.0], np.float32), "steps": np.array(9, np.int64)}}
    update: dict[str, ArrayGroup] = {"g": {"w": np.array([2.0, 0.0], np.float32), "steps": np.array(7, np.int64)}}

    rebased = rebase(update, sent, current, 0.5)

    np.testing.assert_array_equal(rebased["g"]["w"], np.array([3.5, 2.0], np.float32))
    assert rebased["g"]["w"].dtype == np.float32
    assert rebased["g"]["steps"] == 7, "a counter goes as uploaded"
    variance = {"g": {"body.1.running_var": np.array([0.5], np.float32)}}
    moved = {"g": {"body.1.running_var": np.array([0.1], np.float32)}}
    assert rebase(variance, moved, variance, 1.0)["g"]["body.1.running_var"][0] == 0.5, (
        "a statistic goes as uploaded: 0.5 + (0.5 - 0.1) would be another, and one could turn negative")
    fresh = rebase(update, sent, sent, 1.0)
    np.testing.assert_array_equal(fresh["g"]["w"], update["g"]["w"])


def test_the_fedavg_server_takes_fedbuffs_step_from_rebased_updates():
    # Prepare: FedAvg's server at version 1; two updates computed on version 0, staleness 1
    server = algorithms.load("fedavg")(algorithms.hyperparameters("fedavg", {}),
                                       ServerContext("cnn8", DIGITS, seed=0, rounds=3, clients=2))
    version0 = {SHARED: {k: v.copy() for k, v in server.state[SHARED].items()}}
    rng = np.random.default_rng(0)
    version1 = {SHARED: {k: v + rng.normal(0, 0.1, v.shape).astype(v.dtype) for k, v in version0[SHARED].items()}}
    server.state = version1
    changes = [{k: rng.normal(0, 0.1, v.shape).astype(v.dtype) for k, v in version0[SHARED].items()} for _ in range(2)]
    weights, factor = [30.0, 10.0], staleness_factor(1, 0.5)

    # Execute
    server.begin_round(2)
    for change, weight in zip(changes, weights, strict=True):
        update = {SHARED: {k: version0[SHARED][k] + change[k] for k in change}}
        server.accumulate("dev", rebase(update, version0, version1, factor), {}, weight)
    server.end_round(2)

    # Assert: x1 + sum_i n_i s(1) delta_i / sum_i n_i
    for key, value in server.state[SHARED].items():
        expected = version1[SHARED][key] + factor * (30 * changes[0][key] + 10 * changes[1][key]) / 40
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6, err_msg=key)


def test_devices_are_dispatched_up_to_the_concurrency_in_a_seeded_order():
    steps = AsyncSteps(buffer=2, max_staleness=1, concurrency=3, exponent=0.5, seed=4)
    online = [f"dev{i:03d}" for i in range(6)]

    first = steps.to_dispatch(online)
    steps.dispatched(first, train("m1"), 0.0)

    assert len(first) == 3 and first == AsyncSteps(buffer=2, max_staleness=1, concurrency=3, exponent=0.5,
                                                   seed=4).to_dispatch(online)
    assert steps.to_dispatch(online) == [], "three in flight already"
    steps.lost(first[0])
    assert len(again := steps.to_dispatch(online)) == 1 and again[0] not in first[1:]
    assert AsyncSteps(buffer=2, max_staleness=1, concurrency=0, exponent=0.5, seed=4).to_dispatch(online) == online


def test_an_arrival_lands_with_its_staleness_and_too_stale_ones_are_refused():
    # Prepare: dev0 and dev1 train on version 0; two steps close meanwhile with dev2's updates
    steps = AsyncSteps(buffer=1, max_staleness=1, concurrency=0, exponent=0.5, seed=0)
    steps.dispatched(["dev0", "dev1"], train("m0"), 0.0)
    steps.close_step()
    steps.dispatched(["dev2"], train("m1", {"g": {"v": np.ones(1)}}), 1.0)

    # Execute / Assert: dev0 one version behind is taken; a reply naming another request ends nothing
    assert steps.flight_of("dev0", "m1") is None and steps.flight_of("dev9", "m0") is None
    flight = steps.flight_of("dev0", "m0")
    assert flight is not None
    staleness, sent = steps.land(flight)
    assert (staleness, sent) == (1, {"g": {}})
    steps.folded(staleness)
    record = steps.close_step()
    assert (record.arrivals, dict(record.staleness)) == (1, {1: 1})
    flight = steps.flight_of("dev1", "m0")
    assert flight is not None
    staleness, sent = steps.land(flight)
    assert (staleness, sent) == (2, None) and steps.step.too_stale == 1
    assert set(steps.sent) == {1}, "version 0 is let go once no flight can use it"


def test_flights_older_than_the_timeout_expire():
    steps = AsyncSteps(buffer=1, max_staleness=1, concurrency=0, exponent=0.5, seed=0)
    steps.dispatched(["dev0"], train("m0"), 0.0)
    steps.dispatched(["dev1"], train("m0"), 50.0)

    assert steps.expired(100.0, 60.0) == ["dev0"]
    assert set(steps.flights) == {"dev1"}


@pytest.mark.parametrize("algorithm", ALGORITHM_IDS)
def test_every_algorithm_runs_async_or_is_refused_by_name(algorithm):
    config = RunConfig.of(algorithm=algorithm, mode="async")
    server = algorithms.load(algorithm)
    if algorithm in ASYNCHRONOUS:
        check_async_run(config, server)
    else:
        with pytest.raises(ConfigError, match=f"mode async: {algorithm} cannot: .+"):
            check_async_run(config, server)


@pytest.mark.parametrize("changes, names", [
    ({"secure_aggregation": True}, "secure_aggregation"),
    ({"dp": "central", "dp_noise": 1.0}, "dp calibrates"),
    ({"shards": 2}, "shards"),
    ({"late_updates": "next_round"}, "late_updates"),
    ({"fraction": 0.5}, "fraction"),
])
def test_settings_made_for_rounds_are_refused_with_async(changes, names):
    config = RunConfig.of(algorithm="fedavg", mode="async", **changes)
    with pytest.raises(ConfigError, match=f"mode async: {names}"):
        check_async_run(config, algorithms.load("fedavg"))


@pytest.mark.parametrize("key, value", [("mode", "later"), ("buffer", 0), ("max_staleness", -1), ("concurrency", -2),
                                        ("staleness_exponent", -0.5)])
def test_bad_async_settings_name_their_key(key, value):
    with pytest.raises(ConfigError, match=key):
        RunConfig.of(**{key: value})


def test_the_readmes_async_column_says_what_each_algorithm_does():
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    column = dict(re.findall(r"^\| `(\w+)` \|.*\| (yes|no: [^|]+) \|$", readme, flags=re.MULTILINE))
    assert set(column) == set(ALGORITHM_IDS)
    assert {a for a, says in column.items() if says == "yes"} == ASYNCHRONOUS
