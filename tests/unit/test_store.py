"""Unit tests for edge_sdk.store: a device's personal state is its own, for its own run."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from edge_sdk.store import PersonalState, PersonalStore


def _state(client_id: str, run_id: str = "run-1", value: float = 1.0) -> PersonalState:
    return PersonalState(client_id, run_id, "fedper", 4, {"head.weight": np.full((2, 3), value, np.float32)})


def test_devices_sharing_a_state_dir_restore_their_own_state(tmp_path):
    # Prepare: two devices write into one folder
    cam1, cam2 = PersonalStore(tmp_path, "cam-01"), PersonalStore(tmp_path, "cam-02")
    cam1.save(_state("cam-01", value=1.0))
    cam2.save(_state("cam-02", value=2.0))

    # Execute
    restored = PersonalStore(tmp_path, "cam-02").restore("run-1", "fedper")

    # Assert
    assert cam1.path != cam2.path and cam1.path.is_file() and cam2.path.is_file()
    assert restored is not None and restored.client_id == "cam-02"
    np.testing.assert_array_equal(restored.arrays["head.weight"], np.full((2, 3), 2.0, np.float32))


def test_another_devices_state_is_refused_with_a_clear_message(tmp_path, caplog):
    # Prepare: cam-01's file put where cam-02 looks (copied by hand, say)
    cam1, cam2 = PersonalStore(tmp_path, "cam-01"), PersonalStore(tmp_path, "cam-02")
    cam1.save(_state("cam-01"))
    cam1.path.rename(cam2.path)

    # Execute
    with caplog.at_level(logging.ERROR):
        restored = cam2.restore("run-1", "fedper")

    # Assert
    assert restored is None
    assert "personal state of device cam-01, not of cam-02: refused" in caplog.text


def test_the_state_of_another_run_is_not_restored(tmp_path, caplog):
    # Prepare
    store = PersonalStore(tmp_path, "cam-01")
    store.save(_state("cam-01", run_id="run-1"))

    # Execute
    with caplog.at_level(logging.WARNING):
        restored = store.restore("run-2", "fedper")

    # Assert
    assert restored is None and "is not of run run-2" in caplog.text
    assert store.restore("run-1", "fedper") is not None


def test_a_store_refuses_to_save_another_devices_state(tmp_path):
    with pytest.raises(ValueError, match="cam-02"):
        PersonalStore(tmp_path, "cam-01").save(_state("cam-02"))
