"""Unit tests for RepPer's mechanics on tiny digits data, without a broker.

Stage 1 (`fit`) uploads the body only and no classifier exists; stage 2 (`evaluate`) fits a
personal head on the frozen global body, also on a device that never trained; personal names
never appear in the encoded upload.
"""

from __future__ import annotations

from typing import Any, Literal, cast

import msgpack
import numpy as np
import pytest
import torch
from torch import nn

from builtin_tasks import DIGITS, digits_client
from coordinator.algorithms.base import ServerContext
from coordinator.algorithms.repper import RepPerServer
from coordinator.rounds.inprocess import FixedUpdate, play_round
from edge_sdk import wire
from edge_sdk.algorithms.base import Task
from edge_sdk.settings import TrainSettings
from edge_sdk.algorithms.part_sharing import SHARED
from edge_sdk.algorithms.repper import Hyper, RepPerDevice, fit_torch_head
from edge_sdk.config import ConfigError, from_mapping
from edge_sdk.data import ClientData
from edge_sdk.models import statistics_keys
from edge_sdk.protocol import Envelope, Kind

SETTINGS = TrainSettings(model="cnn8", rounds=3, local_epochs=1, batch_size=32, lr=0.05, seed=0)
DEFAULT_HYPER = Hyper()
"""The algorithm's default hyperparameters."""


def make_device(index: int, hyper: Hyper = DEFAULT_HYPER, data: ClientData | None = None) -> RepPerDevice:
    data = data or digits_client(index, num_clients=10, partition="dirichlet", seed=0)
    return RepPerDevice(hyper, SETTINGS, data, "cpu", client_seed=100 + index)


def make_server(hyper: Hyper = DEFAULT_HYPER) -> RepPerServer:
    return RepPerServer(hyper, ServerContext("cnn8", DIGITS, seed=0, rounds=3, clients=10))


def parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def test_stage_one_uploads_the_body_only_and_has_no_classifier() -> None:
    # Prepare
    server, device = make_server(), make_device(0)
    before = parameters(device.model.body)

    # Execute
    result = device.fit(Task(1, server.state, {"selected": ["dev000"]}))

    # Assert
    assert set(result.groups) == {SHARED}
    uploaded = set(result.groups[SHARED])
    assert all(key.startswith("body.") for key in uploaded)
    assert statistics_keys(device.model) <= uploaded, "the released body carries its BatchNorm statistics"
    assert {k: v[0] for k, v in server.update_spec(1)[SHARED].items()} == {
        k: tuple(v.shape) for k, v in result.groups[SHARED].items()}
    assert [name for name, _ in device.model.named_children()] == ["body", "projector"]
    assert not any(True for _ in device.model.projector.parameters())
    assert device.head is None
    assert np.isfinite(result.metrics["loss"])
    assert any(not torch.equal(before[k], v) for k, v in parameters(device.model.body).items())


def test_evaluation_fits_a_head_on_the_frozen_global_body() -> None:
    # Prepare
    server, devices = make_server(), [make_device(0), make_device(1)]
    play_round(server, {"dev000": devices[0], "dev001": devices[1]}, 1)
    device = devices[0]

    # Execute
    metrics = device.evaluate(Task(1, server.state, {"selected": [], "final": True}))

    # Assert: the body's weights are exactly the global ones (a trainer device recalibrates the
    # BatchNorm statistics locally); a linear head was fitted on its features
    body, statistics = device.model.state_dict(), statistics_keys(device.model)
    assert all(np.array_equal(body[k].numpy(), v) for k, v in server.state[SHARED].items() if k not in statistics)
    assert isinstance(device.head, nn.Linear) and device.head.in_features == device.model.feature_dim
    assert 0.0 <= metrics["accuracy"] <= 1.0 and metrics["accuracy"] > 0.5
    assert metrics["global_accuracy"] == metrics["accuracy"]
    assert metrics["num_test"] == device.data.num_test


def test_a_never_selected_device_fits_its_head_and_gets_an_accuracy() -> None:
    # Prepare: devices 0 and 1 train; device 2 never does (a holdout device)
    server, trainers, newcomer = make_server(), [make_device(0), make_device(1)], make_device(2)
    play_round(server, {"dev000": trainers[0], "dev001": trainers[1]}, 1)
    batchnorm = cast(nn.BatchNorm2d, newcomer.model.get_submodule("body.1"))

    # Execute
    metrics = newcomer.evaluate(Task(1, server.state, {"selected": [], "final": True}))

    # Assert: its own BatchNorm statistics were computed from its data; its head was fitted
    assert batchnorm.running_mean is not None and batchnorm.running_mean.abs().sum() > 0
    assert isinstance(newcomer.head, nn.Linear)
    assert 0.5 < metrics["accuracy"] <= 1.0


@pytest.mark.parametrize("head", ["mlp", "svm", "lr", "mlp_sklearn"])
def test_every_head_kind_predicts(head: Literal["mlp", "svm", "lr", "mlp_sklearn"]) -> None:
    # Prepare
    server, device = make_server(), make_device(3, Hyper(head=head))

    # Execute
    metrics = device.evaluate(Task(0, server.state, {"selected": []}))

    # Assert
    assert device.head is not None
    assert 0.5 < metrics["accuracy"] <= 1.0


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_a_torch_head_learns_the_same_whatever_the_scale_of_each_feature(kind: str) -> None:
    # Prepare: features whose dimensions differ in scale by up to 10^4 and in offset, one of
    # them constant (a dead unit), and the same features with every dimension rescaled
    rng = np.random.default_rng(0)
    labels = torch.from_numpy(rng.integers(0, 3, size=90))
    features = torch.from_numpy(rng.normal(size=(90, 6)).astype(np.float32))
    features[:, 0] += 2.0 * labels  # the informative dimension
    features[:, 5] = 4.0  # constant on the training split
    scale = torch.tensor([1e-2, 1e2, 1.0, 3e1, 1e-1, 5.0])
    offset = torch.tensor([5.0, -3.0, 0.0, 1e2, 2.0, 0.0])
    fit: dict[str, Any] = dict(hidden=8, epochs=3, batch_size=16, lr=0.05, seed=1)

    # Execute
    head = fit_torch_head(kind, features, labels, 3, **fit)
    rescaled_head = fit_torch_head(kind, features * scale + offset, labels, 3, **fit)

    # Assert: the same logits on the same (raw, rescaled) inputs; the constant dimension is ignored
    probe = features.clone()
    probe[:, 5] = -7.0  # a value the training split never had
    with torch.no_grad():
        torch.testing.assert_close(head(probe), rescaled_head(probe * scale + offset), rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(head(probe), head(features), rtol=1e-5, atol=1e-5)
    first = head if isinstance(head, nn.Linear) else cast(nn.Linear, head.get_submodule("0"))
    assert torch.all(first.weight[:, 5] == 0)
    assert not head.training


def test_a_single_class_device_still_gets_a_numpy_head() -> None:
    # Prepare
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 1, 8, 8)).astype(np.float32)
    y = np.full(12, 3, dtype=np.int64)
    data = ClientData(x[:8], y[:8], x[8:], y[8:], DIGITS)
    device = make_device(0, Hyper(head="lr"), data)

    # Execute
    metrics = device.evaluate(Task(0, make_server().state, {"selected": []}))

    # Assert
    assert metrics["accuracy"] == 1.0


def test_the_personal_head_never_appears_in_the_encoded_upload() -> None:
    # Prepare: a device that has fitted its personal head, then trains again
    server, device = make_server(), make_device(0)
    device.evaluate(Task(1, server.state, {"selected": [], "final": False}))
    result = device.fit(Task(2, server.state, {"selected": ["dev000"]}))

    # Execute
    payload = wire.encode(Envelope(Kind.TRAIN_RES, "dev000", groups=result.groups, metrics=result.metrics))

    # Assert: the body travels, keys as msgpack strings; nothing of the head does
    assert device.head is not None
    assert set(result.groups[SHARED]) == set(device.partition.shared)
    for key in device.partition.shared:
        assert msgpack.packb(key) in payload
    assert b"head" not in payload


def test_server_takes_the_example_weighted_mean_of_the_bodies() -> None:
    # Prepare
    server = make_server()
    first = {k: np.full_like(v, 1.0) for k, v in server.state[SHARED].items()}
    second = {k: np.full_like(v, 5.0) for k, v in server.state[SHARED].items()}

    # Execute
    play_round(server, {"a": FixedUpdate({SHARED: first}, 30), "b": FixedUpdate({SHARED: second}, 10)}, 1)

    # Assert: (30 * 1 + 10 * 5) / 40 = 2
    assert all(np.allclose(v, 2.0) for v in server.state[SHARED].values())


def test_a_configured_projector_is_shared_and_the_head_still_sits_on_the_body() -> None:
    # Prepare
    hyper = Hyper(projection_dim=16)
    server, device = make_server(hyper), make_device(0, hyper)

    # Execute
    result = device.fit(Task(1, server.state, {"selected": ["dev000"]}))
    device.evaluate(Task(1, server.state, {"selected": []}))

    # Assert
    assert any(key.startswith("projector.") for key in result.groups[SHARED])
    assert set(result.groups[SHARED]) == set(server.state[SHARED])
    assert device.head.in_features == device.model.feature_dim


@pytest.mark.parametrize("values", [{"variant": "sideways"}, {"temperature": "0"}, {"head": "tree"}])
def test_bad_hyperparameters_are_rejected(values: dict[str, str]) -> None:
    # Execute / Assert
    with pytest.raises(ConfigError):
        from_mapping(Hyper, values)
