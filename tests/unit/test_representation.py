"""The coordinator's side of the export: the global body rebuilt from state arrays in memory.

The release exports the body from the arrays the coordinator holds, without a checkpoint: a
complete body loads exactly, a body without its BatchNorm statistics needs them from the
devices (and loads once they are given), a personal body is refused, and the released file
carries the task's metadata.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from coordinator.releases.phase import export_release
from coordinator.releases.representation import (
    RepresentationError,
    body_statistics_needed,
    build_run_body,
    representation,
    save_body_statistics,
    saved_body_statistics,
)
from coordinator.run.folder import RunFolder
from edge_sdk.models import statistics_keys

CONFIG = {"algorithm": "fedavg", "dataset": "digits", "model": "cnn8", "seed": 3}


def global_state(seed: int = 5) -> dict[str, dict[str, np.ndarray]]:
    """A cnn8 body's arrays as a global state holds them (`body.*`), with non-initial statistics."""
    torch.manual_seed(seed)
    body = build_run_body(CONFIG).body
    for key in statistics_keys(body):
        if key.endswith(("running_mean", "running_var")):
            body.state_dict()[key].uniform_(0.5, 1.5)
    return {"shared": {f"body.{key}": value.numpy().copy() for key, value in body.state_dict().items()}}


def test_a_complete_global_body_loads_exactly_and_needs_nothing_from_the_devices() -> None:
    # Prepare
    state = global_state()

    # Execute
    needed = body_statistics_needed(state, CONFIG, run_id="r1")
    loaded = representation(state, CONFIG, run_id="r1", round_=4)

    # Assert
    assert needed == {}
    assert not loaded.body.training and loaded.input_shape == (1, 8, 8)
    for key, value in loaded.body.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), state["shared"][f"body.{key}"])
    assert loaded.metadata["task"]["kind"] == "image" and loaded.metadata["task"]["input_shape"] == [1, 8, 8]
    assert (loaded.metadata["algorithm"], loaded.metadata["run_id"], loaded.metadata["round"]) == ("fedavg", "r1", 4)


def test_missing_statistics_are_asked_for_and_then_loaded(tmp_path: Path) -> None:
    # Prepare
    full = global_state()["shared"]
    statistics = {key: value for key, value in full.items() if key.rsplit(".", 1)[-1] in
                  ("running_mean", "running_var", "num_batches_tracked")}
    state = {"shared": {key: value for key, value in full.items() if key not in statistics}}

    # Execute
    needed = body_statistics_needed(state, CONFIG, run_id="r1")
    with pytest.raises(RepresentationError, match=r"lacks the body's BatchNorm running statistics .*--release"):
        representation(state, CONFIG, run_id="r1", round_=2)
    loaded = representation(state, CONFIG, run_id="r1", round_=2, statistics=statistics)
    save_body_statistics(RunFolder(tmp_path), 2, statistics)

    # Assert
    assert needed == {key: value.shape for key, value in sorted(statistics.items())}
    for key, value in loaded.body.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), full[f"body.{key}"])
    assert sorted(saved_body_statistics(RunFolder(tmp_path), 2)) == sorted(statistics)
    assert saved_body_statistics(RunFolder(tmp_path), 3) == {}


def test_a_personal_body_and_another_part_are_refused() -> None:
    # Prepare
    state = {"shared": {"head.weight": np.zeros((10, 128), np.float32)}}

    # Execute / Assert
    with pytest.raises(RepresentationError, match="its body is personal"):
        body_statistics_needed(state, {**CONFIG, "algorithm": "lg_fedavg"}, run_id="r1")
    with pytest.raises(ValueError, match="exportable parts: body"):
        representation(global_state(), CONFIG, run_id="r1", round_=1, part="head")


def test_the_release_exports_the_body_held_in_memory(tmp_path: Path) -> None:
    # Prepare
    state = global_state()

    # Execute
    release = export_release(RunFolder(tmp_path), state, CONFIG, run_id="r1", round_=4)

    # Assert
    assert release.path == tmp_path / "release" / "representation.onnx"
    assert release.path.read_bytes() == release.data
    written = {p.key: json.loads(p.value) for p in onnx.load(str(release.path)).metadata_props}
    assert written == release.metadata and release.metadata["feature_dim"] == 128
    assert release.manifest()["metadata"]["task"]["name"] == "digits"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["release"]
