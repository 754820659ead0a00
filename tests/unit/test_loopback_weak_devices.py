"""Weak devices (LiteClient) in runs over the loopback broker (tests/loopback_runs.py): one that
gets no representation ends with the reason, one in a validation run fits and is scored on the
same held-out split a trainer with its id would hold out.
"""

from __future__ import annotations

import numpy as np

from edge_sdk import wire
from edge_sdk.protocol import Envelope, Kind
from loopback_runs import sealed_test_split


def test_a_weak_device_ends_with_the_reason_when_the_run_releases_nothing(federation, caplog):
    # Prepare: FedAvg without release; one of the three devices is a weak one
    coordinator = federation.coordinator(federation.config(rounds=1))
    federation.start_device(0, 3)
    federation.start_device(1, 3)
    lite = federation.start_lite(2, 3)

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
                      state_dir=federation.state_dir("dev002"),
                      transport=federation.broker.transport("dev002", will=will))
    federation.run_device(lite)

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

