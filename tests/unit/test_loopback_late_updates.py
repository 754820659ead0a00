"""Slow devices over the loopback broker (tests/loopback_runs.py): the first round waits for a
device slower than the grace; later, a late update is discarded or folded into the next round,
as `late_updates` says, and counted either way.
"""

from __future__ import annotations

import json

from loopback_runs import Gate


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

