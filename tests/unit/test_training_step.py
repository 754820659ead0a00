"""Unit tests for a trainer's own training step: a user optimizer and loss replace SGD and
cross-entropy in the FedAvg family, the algorithm's own terms still apply, and algorithms with
their own objective refuse them by name."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from builtin_tasks import digits_client
from edge_sdk.settings import TrainSettings
from edge_sdk.algorithms import load as load_device
from edge_sdk.algorithms.base import Task, TrainingStepRefused
from edge_sdk.algorithms.torch_device import TorchDevice
from edge_sdk.client import EdgeClient
from edge_sdk.protocol import Envelope, Kind

SETTINGS = TrainSettings(model="cnn8", rounds=2, local_epochs=1, batch_size=32, lr=0.05, seed=0)


def smoothed(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets, label_smoothing=0.2)


def adam(params, settings: TrainSettings) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=settings.lr / 10)


@pytest.fixture(scope="module")
def data():
    return digits_client(0)


def make(algorithm_id: str, data, **overrides):
    device_cls = load_device(algorithm_id)
    return device_cls(device_cls.Hyper(), SETTINGS, data, "cpu", 1, **overrides)


def test_a_user_loss_replaces_cross_entropy(data) -> None:
    # Prepare
    default, custom = make("fedavg", data), make("fedavg", data, loss=smoothed)
    xb, yb = default.train_x[:32], default.train_y[:32]

    # Execute
    default_loss = default.local_loss(Task(1, {}, {}))(xb, yb)
    custom_loss = custom.local_loss(Task(1, {}, {}))(xb, yb)

    # Assert: the same weights, the user's loss of the same logits
    logits = default.model(xb)
    torch.testing.assert_close(default_loss, F.cross_entropy(logits, yb))
    torch.testing.assert_close(custom_loss, smoothed(logits, yb))
    assert not torch.isclose(custom_loss, default_loss)


def test_fedprox_adds_its_proximal_term_to_the_user_loss(data) -> None:
    # Prepare: move the weights away from the anchor the loss is built at
    device = make("fedprox", data, loss=smoothed)
    loss_fn = device.local_loss(Task(1, {}, {}))
    with torch.no_grad():
        for param in device.model.parameters():
            param.add_(0.01)
    xb, yb = device.train_x[:32], device.train_y[:32]
    count = sum(p.numel() for p in device.model.parameters())

    # Execute
    value = loss_fn(xb, yb)

    # Assert: mu/2 * ||0.01||^2 over every parameter on top of the smoothed loss
    expected = smoothed(device.model(xb), yb) + 0.5 * device.hyper.mu * count * 0.01**2
    torch.testing.assert_close(value, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("algorithm_id", ["fedavg", "fedrep", "fedavg_ft", "local"])
def test_a_user_optimizer_trains_every_phase(algorithm_id: str, data) -> None:
    # Prepare
    device = make(algorithm_id, data, optimizer=adam, loss=smoothed)
    before = {k: v.clone() for k, v in device.model.state_dict().items()}

    # Execute
    optimizer = device.optimizer()
    result = device.fit(Task(1, {}, {}))

    # Assert
    assert isinstance(optimizer, torch.optim.Adam) and optimizer.param_groups[0]["lr"] == pytest.approx(0.005)
    assert result.metrics["loss"] > 0
    assert any(not torch.equal(before[k], v) for k, v in device.model.state_dict().items())


def test_the_default_step_is_unchanged_without_an_override(data) -> None:
    # Execute
    optimizer = make("fedavg", data).optimizer()

    # Assert
    assert isinstance(optimizer, torch.optim.SGD)
    assert optimizer.param_groups[0]["lr"] == 0.05 and optimizer.param_groups[0]["momentum"] == 0.9


@pytest.mark.parametrize("algorithm_id", ["repper", "dualfed", "dc_pfl", "cd2_pfed", "fedios"])
@pytest.mark.parametrize("override", ["optimizer", "loss"])
def test_algorithms_with_their_own_objective_refuse_an_override(algorithm_id: str, override: str, data) -> None:
    with pytest.raises(TrainingStepRefused, match=f"^{algorithm_id} has its own local objective"):
        make(algorithm_id, data, **{override: smoothed if override == "loss" else adam})


def test_edge_client_hands_the_factory_and_the_step_to_the_algorithm(tmp_path: Path, data) -> None:
    # Prepare
    def factory(task):
        from edge_sdk.models import BUILTINS

        return BUILTINS["cnn8"](task)

    client = EdgeClient("dev-1", data, state_dir=tmp_path, model=factory, optimizer=adam, loss=smoothed)
    welcome = Envelope(Kind.WELCOME, "coordinator", run_id="run", config={
        "algorithm": "fedprox", "hyper": {}, "settings": dataclasses.asdict(SETTINGS)})

    # Execute
    client.join(welcome)

    # Assert
    algorithm = client.algorithm
    assert isinstance(algorithm, TorchDevice)
    assert algorithm.model_spec is factory
    assert algorithm.user_optimizer is adam and algorithm.user_loss is smoothed
    assert algorithm.base_model().feature_dim == 128
