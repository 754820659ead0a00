"""Validation runs over the loopback broker (tests/loopback_runs.py): every algorithm trains and
scores on its devices' training split only, their test split never read.
"""

from __future__ import annotations

import pytest

from edge_sdk.algorithms import ALGORITHM_IDS
from loopback_runs import sealed_test_split


@pytest.mark.parametrize("algorithm", ALGORITHM_IDS)
def test_a_validation_run_trains_and_scores_on_the_training_split_only(federation, algorithm):
    # Prepare: devices whose test split cannot be read; a fifth of each training split held out
    from edge_sdk.data import load_client_data

    config = federation.config(algorithm=algorithm, validation_fraction=0.2)
    coordinator = federation.coordinator(config)
    devices = [federation.start_device(i, 3, wrap=sealed_test_split) for i in range(3)]
    with pytest.raises(AssertionError, match="test split was read"):
        _ = sealed_test_split(load_client_data("digits", num_clients=3, index=0, seed=0)).test_x

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

