"""FediOS mechanics on tiny data: orthogonal blocks, block assignment, the model, the upload."""

from __future__ import annotations

import json
import logging

import msgpack
import numpy as np
import pytest
import torch

from coordinator import checkpoint
from coordinator.algorithms.base import ServerContext
from coordinator.algorithms.fedios import FediOSServer
from edge_sdk import wire
from edge_sdk.algorithms.base import Task, TrainSettings
from edge_sdk.algorithms.fedios import FediOSDevice, Hyper, orthogonal_columns, projection
from edge_sdk.algorithms.part_sharing import SHARED
from edge_sdk.data import load_client_data
from edge_sdk.params import check_arrays
from edge_sdk.protocol import Envelope, Kind

CAPACITY = 3  # small D = 4 * 128 keeps the QR cheap


@pytest.fixture(scope="module")
def data():
    return load_client_data("digits", num_clients=10, index=0, partition="dirichlet", seed=0)


def make_server(data, clients: int = CAPACITY, capacity: int = 0) -> FediOSServer:
    return FediOSServer(Hyper(capacity=capacity), ServerContext("cnn8", data.meta, seed=0, rounds=5, clients=clients))


def make_device(data, assignment: dict) -> FediOSDevice:
    settings = TrainSettings("cnn8", rounds=5, local_epochs=1, batch_size=32, lr=0.05, seed=0)
    return FediOSDevice(Hyper(), settings, data, "cpu", client_seed=7, assignment=assignment)


def test_blocks_are_orthonormal_and_mutually_orthogonal() -> None:
    # Prepare
    feature_dim, capacity = 4, 5
    dim = (capacity + 1) * feature_dim

    # Execute
    q = orthogonal_columns(dim, dim, seed=3)
    blocks = [projection(q, b, feature_dim) for b in range(capacity + 1)]

    # Assert: P_i^T P_i = I, P_i^T P_j = 0 (block 0 is P^g); deterministic in the seed
    for i, p_i in enumerate(blocks):
        for j, p_j in enumerate(blocks):
            expected = np.eye(feature_dim) if i == j else np.zeros((feature_dim, feature_dim))
            np.testing.assert_allclose(p_i.T @ p_j, expected, atol=1e-12)
    np.testing.assert_array_equal(q, orthogonal_columns(dim, dim, seed=3))
    assert not np.allclose(q, orthogonal_columns(dim, dim, seed=4))


def test_a_prefix_of_columns_equals_the_full_q() -> None:
    # Prepare
    dim = 24

    # Execute
    full, prefix = orthogonal_columns(dim, dim, seed=0), orthogonal_columns(dim, 8, seed=0)

    # Assert
    np.testing.assert_allclose(prefix, full[:, :8], atol=1e-12)


def test_server_assigns_unique_stable_blocks_also_to_late_joiners(data) -> None:
    # Prepare
    server = make_server(data)

    # Execute: two devices, one registers again, a round passes, a late joiner arrives
    first, second = server.assignment("dev000"), server.assignment("dev001")
    again = server.assignment("dev000")
    server.begin_round(1)
    server.accumulate("dev000", {SHARED: server.state[SHARED]}, {}, weight=1.0)
    server.end_round(1)
    late = server.assignment("dev002")

    # Assert
    assert again == first
    assert sorted(a["block"] for a in (first, second, late)) == [1, 2, 3]
    assert all(a["capacity"] == CAPACITY and a["seed"] == 0 for a in (first, second, late))
    assert json.loads(json.dumps(late)) == late
    assert msgpack.unpackb(msgpack.packb(late)) == late
    assert "blocks" not in server.task_groups(2) and "blocks" not in server.eval_groups()


def test_block_map_survives_a_coordinator_restart(data, tmp_path) -> None:
    # Prepare
    server = make_server(data)
    blocks = {cid: server.assignment(cid)["block"] for cid in ("dev000", "dev001")}
    path = tmp_path / "checkpoint.msgpack"
    checkpoint.save(path, checkpoint.Checkpoint("run", 1, "fp", server.state))

    # Execute: a new coordinator process restores the checkpointed state
    restarted = make_server(data)
    restarted.state = checkpoint.load(path).state
    again = {cid: restarted.assignment(cid)["block"] for cid in ("dev000", "dev001")}
    newcomer = restarted.assignment("dev009")["block"]

    # Assert
    assert again == blocks
    assert newcomer not in blocks.values()


def test_overflow_beyond_capacity_shares_a_block_and_warns(data, caplog) -> None:
    # Prepare
    server = make_server(data, clients=10, capacity=2)
    server.assignment("dev000"), server.assignment("dev001")

    # Execute
    with caplog.at_level(logging.WARNING):
        extra = server.assignment("dev002")

    # Assert
    assert extra["block"] in (1, 2)
    assert "capacity" in caplog.text


def test_model_has_three_parts_and_orthogonal_generic_and_personal_features(data) -> None:
    # Prepare
    server = make_server(data)
    device = make_device(data, server.assignment("dev000"))
    x = device.test_x[:8]

    # Execute
    with torch.no_grad():
        phi_g, phi_p = device.model.generic_features(x), device.model.personal_features(x)

    # Assert
    assert [name for name, _ in device.model.named_children()] == ["body", "personal_body", "head"]
    assert device.model.head.in_features == (CAPACITY + 1) * 128
    assert phi_g.shape == phi_p.shape == (8, (CAPACITY + 1) * 128)
    assert (phi_g * phi_p).sum(dim=1).abs().max() < 1e-3 * phi_g.norm() * phi_p.norm()
    assert not any(k.startswith(("generic_t", "personal_t")) for k in device.model.state_dict())


def test_devices_use_their_assigned_mutually_orthogonal_blocks(data) -> None:
    # Prepare
    server = make_server(data)

    # Execute
    first = make_device(data, server.assignment("dev000")).model
    second = make_device(data, server.assignment("dev001")).model

    # Assert: same generic projection, orthogonal personal ones (buffers hold P^T)
    torch.testing.assert_close(first.generic_t, second.generic_t)
    cross = first.personal_t @ second.personal_t.T
    assert cross.abs().max() < 1e-5
    assert (first.generic_t @ first.personal_t.T).abs().max() < 1e-5


def test_upload_holds_body_and_head_but_never_personal_body(data) -> None:
    # Prepare
    server = make_server(data)
    device = make_device(data, server.assignment("dev000"))
    personal_keys = [k for k in device.model.state_dict() if k.startswith("personal_body.")]

    # Execute
    result = device.fit(Task(1, server.task_groups(1), {}))
    payload = wire.encode(Envelope(Kind.TRAIN_RES, "dev000", groups=result.groups, metrics=result.metrics))

    # Assert
    check_arrays(SHARED, result.groups[SHARED], server.update_spec(1)[SHARED])
    assert personal_keys and not any(key.encode() in payload for key in personal_keys)
    assert b"body.0.weight" in payload and b"head.weight" in payload
    assert set(device.personal_state()) >= set(personal_keys)


def test_evaluate_reports_fused_and_global_accuracy(data) -> None:
    # Prepare
    server = make_server(data)
    device = make_device(data, server.assignment("dev000"))
    device.fit(Task(1, server.task_groups(1), {}))

    # Execute
    metrics = device.evaluate(Task(1, server.eval_groups(), {}))
    with torch.no_grad():
        device.model.eval()
        expected = device.model.head(device.model.body(device.test_x) @ device.model.generic_t)
        global_accuracy = float((expected.argmax(1) == device.test_y).float().mean())

    # Assert
    assert 0.0 <= metrics["accuracy"] <= 1.0
    assert metrics["global_accuracy"] == pytest.approx(global_accuracy)
    assert metrics["num_test"] == data.num_test


def test_device_refuses_a_missing_block(data) -> None:
    # Prepare
    assignment: dict = {}

    # Execute / Assert
    with pytest.raises(ValueError, match="block"):
        make_device(data, assignment)
