"""Every algorithm with a user's model: one local round (device fit, server aggregate, device
evaluation) in process on a tabular task with a hand-written nn.Sequential MLP and on a
non-square RGB image task with a small user CNN."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits, load_wine

import user_models
from coordinator.algorithms import load as load_server
from coordinator.algorithms.base import ServerContext
from edge_sdk import wire
from edge_sdk.settings import TrainSettings
from edge_sdk.algorithms import ALGORITHM_IDS
from edge_sdk.algorithms import load as load_device
from edge_sdk.algorithms.base import Task
from edge_sdk.data import ClientData
from edge_sdk.data.task import TaskSpec
from edge_sdk.params import check_arrays, floats_finite
from edge_sdk.protocol import Envelope, Kind

SETTINGS = TrainSettings(model="tests.user_models:unused", rounds=2, local_epochs=1,
                         batch_size=16, lr=0.05, seed=0)


pytestmark = pytest.mark.usefixtures("one_thread")


def split_clients(x: np.ndarray, y: np.ndarray, task: TaskSpec, clients: int) -> list[ClientData]:
    """`clients` interleaved shares of (x, y), each split 3:1 into train and test."""
    datas = []
    for index in range(clients):
        xs, ys = x[index::clients], y[index::clients]
        cut = 3 * len(ys) // 4
        datas.append(ClientData(xs[:cut], ys[:cut], xs[cut:], ys[cut:], task=task))
    return datas


def wine_clients() -> list[ClientData]:
    """scikit-learn's wine: 13 standardized features, 3 classes."""
    wine = load_wine()
    mean, std = wine.data.mean(0), wine.data.std(0)
    task = TaskSpec("wine", "features", (13,), 3, tuple(wine.target_names), tuple(mean), tuple(std))
    x = task.normalize(wine.data[:160])
    return split_clients(x, wine.target[:160].astype(np.int64), task, 2)


def camera_clients() -> list[ClientData]:
    """The digits as 12x10 RGB images (upsampled, channels tinted differently)."""
    digits = load_digits()
    images = torch.from_numpy((digits.data[:240] / 16.0).astype(np.float32)).view(-1, 1, 8, 8)
    tint = torch.tensor([1.0, 0.7, 0.4]).view(1, 3, 1, 1)
    rgb = torch.nn.functional.interpolate(images, size=(12, 10), mode="bilinear") * tint
    task = TaskSpec("camera", "image", (3, 12, 10), 10, tuple(str(i) for i in range(10)),
                    (0.3, 0.2, 0.1), (0.4, 0.3, 0.2))
    return split_clients(task.normalize(rgb.numpy()), digits.target[:240].astype(np.int64), task, 2)


CASES = {"tabular_mlp": (wine_clients, user_models.tiny_mlp), "image_cnn": (camera_clients, user_models.tiny_cnn)}


def over_the_wire(groups: dict) -> dict:
    """The groups as the coordinator receives them (encoded and decoded)."""
    envelope = Envelope(Kind.TRAIN_RES, "c", run_id="run", round=1, groups=groups, metrics={"num_examples": 1})
    return wire.decode(wire.encode(envelope)).groups


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("algorithm_id", ALGORITHM_IDS)
def test_every_algorithm_runs_a_round_on_a_user_model(algorithm_id: str, case: str) -> None:
    # Prepare
    make_clients, factory = CASES[case]
    datas = make_clients()
    server_cls, device_cls = load_server(algorithm_id), load_device(algorithm_id)
    server = server_cls(server_cls.Hyper(), ServerContext(factory, datas[0].task, seed=0, rounds=2, clients=2))
    devices = [device_cls(device_cls.Hyper(), SETTINGS, data, "cpu", 100 + i, server.assignment(f"c{i}"), model=factory)
               for i, data in enumerate(datas)]

    # Execute: one round, then every device's evaluation of the new global state
    server.begin_round(1)
    for i, device in enumerate(devices):
        result = device.fit(Task(1, server.task_groups(1), server.task_config(1)))
        groups = over_the_wire(result.groups)
        assert set(groups) == set(server.update_spec(1))
        for name, spec in server.update_spec(1).items():
            check_arrays(name, groups[name], spec)
        server.validate_update(f"c{i}", groups, result.metrics, device.data.num_train)
        server.accumulate(f"c{i}", groups, result.metrics, float(result.metrics["num_examples"]))
    server.end_round(1)
    metrics = [device.evaluate(Task(1, server.eval_groups(), {"final": True})) for device in devices]

    # Assert
    assert all(0.0 <= m["accuracy"] <= 1.0 for m in metrics)
    assert all(floats_finite(group) for group in server.state.values())
    assert all(floats_finite(device.personal_state()) for device in devices)
