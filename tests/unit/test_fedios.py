"""FediOS mechanics on tiny data: orthogonal blocks, block assignment, the model, the upload."""

from __future__ import annotations

import json
import logging

import msgpack
import pytest
import torch

from builtin_tasks import digits_client
from coordinator.algorithms.base import ServerContext
from coordinator.algorithms.fedios import FediOSServer
from coordinator.rounds.inprocess import FixedUpdate, play_round
from coordinator.run import checkpoint
from coordinator.run.folder import RunFolder
from edge_sdk import wire
from edge_sdk.settings import TrainSettings
from edge_sdk.algorithms.base import Task
from edge_sdk.algorithms.fedios import FediOSDevice, Hyper, project
from edge_sdk.algorithms.part_sharing import SHARED
from edge_sdk.params import check_arrays
from edge_sdk.protocol import Envelope, Kind
from saved_runs import checkpoint_at

CAPACITY = 3


@pytest.fixture(scope="module")
def data():
    return digits_client(0, num_clients=10, partition="dirichlet", seed=0)


def make_server(data, clients: int = CAPACITY, capacity: int = 0) -> FediOSServer:
    return FediOSServer(Hyper(capacity=capacity), ServerContext("cnn8", data.task, seed=0, rounds=5, clients=clients))


def make_device(data, assignment: dict) -> FediOSDevice:
    settings = TrainSettings("cnn8", rounds=5, local_epochs=1, batch_size=32, lr=0.05, seed=0)
    return FediOSDevice(Hyper(), settings, data, "cpu", client_seed=7, assignment=assignment)


def test_projections_are_orthonormal_and_mutually_orthogonal() -> None:
    # Prepare: the projection matrices P_b, read off by projecting the identity
    feature_dim, capacity = 4, 5
    dim = (capacity + 1) * feature_dim
    identity = torch.eye(feature_dim)

    # Execute
    blocks = [project(identity, b, dim).T for b in range(capacity + 1)]  # P_b, dim x d

    # Assert: P_i^T P_i = I, P_i^T P_j = 0 (block 0 is P^g); no block beyond the capacity
    for i, p_i in enumerate(blocks):
        for j, p_j in enumerate(blocks):
            expected = identity if i == j else torch.zeros(feature_dim, feature_dim)
            torch.testing.assert_close(p_i.T @ p_j, expected)
    with pytest.raises(ValueError, match="block 6"):
        project(identity, capacity + 1, dim)


def test_server_assigns_unique_stable_blocks_also_to_late_joiners(data) -> None:
    # Prepare
    server = make_server(data)

    # Execute: two devices, one registers again, a round passes, a late joiner arrives
    first, second = server.assignment("dev000"), server.assignment("dev001")
    again = server.assignment("dev000")
    play_round(server, {"dev000": FixedUpdate({SHARED: server.state[SHARED]}, 1)}, 1)
    late = server.assignment("dev002")

    # Assert
    assert again == first
    assert sorted(a["block"] for a in (first, second, late)) == [1, 2, 3]
    assert all(a == {"block": a["block"], "capacity": CAPACITY} for a in (first, second, late))
    assert json.loads(json.dumps(late)) == late
    assert msgpack.unpackb(msgpack.packb(late)) == late
    assert "blocks" not in server.task_groups(2) and "blocks" not in server.eval_groups()


def test_block_map_survives_a_coordinator_restart(data, tmp_path) -> None:
    # Prepare
    server = make_server(data)
    blocks = {cid: server.assignment(cid)["block"] for cid in ("dev000", "dev001")}
    path = RunFolder(tmp_path).checkpoint
    checkpoint.save(path, checkpoint.Checkpoint("run", 1, "fp", server.state))

    # Execute: a new coordinator process restores the checkpointed state
    restarted = make_server(data)
    restarted.state = checkpoint_at(path).state
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
    assert phi_g.abs().sum() > 0 and phi_p.abs().sum() > 0
    assert torch.equal((phi_g * phi_p).sum(dim=1), torch.zeros(8))
    assert not any(k.startswith("block") for k in device.model.state_dict())


def test_devices_use_their_assigned_mutually_orthogonal_blocks(data) -> None:
    # Prepare
    server = make_server(data)
    device = make_device(data, server.assignment("dev000"))
    first, second = device.model, make_device(data, server.assignment("dev001")).model
    x = device.test_x[:8]

    # Execute: where each device's personal features live in R^D
    with torch.no_grad():
        support = [model.personal_features(x).abs().sum(dim=0) > 0 for model in (first, second)]
        generic = first.generic_features(x).abs().sum(dim=0) > 0

    # Assert: the generic block and the two personal blocks are disjoint, hence orthogonal
    assert [first.block, second.block] == [1, 2]
    assert not (support[0] & support[1]).any() and not (generic & (support[0] | support[1])).any()
    for block, used in ((0, generic), (1, support[0]), (2, support[1])):
        assert used.any() and used.nonzero().min() >= block * 128 and used.nonzero().max() < (block + 1) * 128


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
        expected = device.model.head(project(device.model.body(device.test_x), 0, device.model.head.in_features))
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
