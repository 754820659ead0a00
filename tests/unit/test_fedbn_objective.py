"""FedBN against Algorithm 1 of Li et al. (ICLR 2021): every BatchNorm layer (gamma, beta and the
running statistics) stays on its device, every other layer is averaged, w = sum_k (n_k / n) w_k.

The BatchNorm layers are found here by module type, independently of the algorithm's partition;
the devices hold different data, so their BatchNorm layers drift apart and a layer that was
averaged or overwritten would show.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from builtin_tasks import DIGITS, digits_client
from coordinator.algorithms import load as load_server
from coordinator.algorithms.base import ServerContext
from coordinator.rounds.inprocess import play_round
from edge_sdk import wire
from edge_sdk.algorithms.base import Task
from edge_sdk.algorithms.fedbn import FedBNDevice
from edge_sdk.models import build_model
from edge_sdk.privacy.dpsgd import DpSgdRefused, check_dp_sgd
from edge_sdk.protocol import Envelope, Kind
from edge_sdk.settings import TrainSettings
from objectives import snapshot

NUM_CLIENTS = 3
SETTINGS = TrainSettings(model="cnn8", rounds=3, local_epochs=1, batch_size=32, lr=0.05, seed=0)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def datas():
    """Three dirichlet digits clients, cut to different sizes so that the weights n_k / n differ."""
    parts = [digits_client(i, num_clients=NUM_CLIENTS, partition="dirichlet", seed=0) for i in range(NUM_CLIENTS)]
    return [dataclasses.replace(d, train_x=d.train_x[:size], train_y=d.train_y[:size], test_x=d.test_x[:48],
                                test_y=d.test_y[:48]) for d, size in zip(parts, (96, 64, 40), strict=True)]


def make_server():
    cls = load_server("fedbn")
    return cls(cls.Hyper(), ServerContext("cnn8", DIGITS, seed=SETTINGS.seed, rounds=SETTINGS.rounds,
                                          clients=NUM_CLIENTS))


def make_devices(datas) -> dict[str, FedBNDevice]:
    return {f"dev{i}": FedBNDevice(FedBNDevice.Hyper(), SETTINGS, d, "cpu", client_seed=500 + i)
            for i, d in enumerate(datas)}


def batchnorm_keys(model: nn.Module) -> set[str]:
    """Every state key of every BatchNorm module: weight, bias, running mean and variance, batch count."""
    return {f"{prefix}.{key}" for prefix, module in model.named_modules()
            if isinstance(module, nn.modules.batchnorm._BatchNorm) for key in module.state_dict()}


def own_batchnorm(device: FedBNDevice) -> dict[str, torch.Tensor]:
    state = snapshot(device.model)
    return {key: state[key] for key in batchnorm_keys(device.model)}


def test_the_model_has_batchnorm_layers_with_parameters_and_statistics() -> None:
    keys = batchnorm_keys(build_model("cnn8", DIGITS, seed=0))
    assert any(k.endswith(".weight") for k in keys) and any(k.endswith(".running_mean") for k in keys)


def test_uploads_hold_every_non_batchnorm_parameter_and_nothing_of_a_batchnorm_layer(datas) -> None:
    # Prepare
    server, devices = make_server(), make_devices(datas)
    model = devices["dev0"].model
    bn = batchnorm_keys(model)
    non_bn = set(model.state_dict()) - bn

    # Execute
    rounds = [play_round(server, devices, r) for r in (1, 2)]

    # Assert: up and down, only the non-BN layers; no BN key name even in the encoded reply
    for played in rounds:
        for client_id, result in played.results.items():
            uploaded = {key for group in result.groups.values() for key in group}
            assert uploaded == non_bn
            payload = wire.encode(Envelope(Kind.TRAIN_RES, client_id, groups=result.groups, metrics=result.metrics))
            assert [key for key in bn if key.encode() in payload] == []
    assert {key for group in server.task_groups(3).values() for key in group} == non_bn
    assert {key for group in server.update_spec(3).values() for key in group} == non_bn


def test_the_global_non_batchnorm_layers_are_the_example_weighted_mean(datas) -> None:
    # Prepare
    server, devices = make_server(), make_devices(datas)

    # Execute
    played = play_round(server, devices, 1)

    # Assert: w = sum_k n_k w_k / sum_k n_k, layer by layer
    n = {cid: float(len(devices[cid].train_y)) for cid in devices}
    assert len(set(n.values())) == NUM_CLIENTS
    (group,) = server.state.values()
    for key, value in group.items():
        expected = sum(n[cid] * played.results[cid].groups["shared"][key] for cid in devices) / sum(n.values())
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6)


def test_a_device_keeps_its_own_batchnorm_layers_when_the_global_model_comes_down(datas) -> None:
    # Prepare: a round trains every device's BatchNorm layers on its own data
    server, devices = make_server(), make_devices(datas)
    initial = own_batchnorm(FedBNDevice(FedBNDevice.Hyper(), SETTINGS, datas[0], "cpu", client_seed=1))
    play_round(server, devices, 1)
    own = {cid: own_batchnorm(device) for cid, device in devices.items()}

    # Execute: the next round's global model comes down
    task = server.task_groups(2)
    for device in devices.values():
        device.load_shared(Task(2, task, {}))

    # Assert: BN layers bit-identical to the device's own, trained (not the initial ones) and
    # different across devices; every other layer is the global one
    for cid, device in devices.items():
        for key, value in own_batchnorm(device).items():
            assert torch.equal(value, own[cid][key]), key
        state = device.model.state_dict()
        for key, value in server.state["shared"].items():
            np.testing.assert_array_equal(state[key].numpy(), value)
    weights = [k for k in initial if k.endswith((".weight", ".bias"))]
    assert weights and all(not torch.equal(own["dev0"][k], initial[k]) for k in weights)
    assert all(not torch.equal(own["dev0"][k], own["dev1"][k]) for k in weights)


def test_local_training_trains_the_whole_model_batchnorm_included(datas) -> None:
    # Prepare
    server, device = make_server(), make_devices(datas[:1])["dev0"]
    device.load_shared(Task(1, server.task_groups(1), {}))
    before = snapshot(device.model)

    # Execute
    device.fit(Task(1, server.task_groups(1), {}))

    # Assert: every parameter moved (cross-entropy over all layers, as FedAvg's local update)
    for name, parameter in device.model.named_parameters():
        assert not torch.equal(parameter.detach(), before[name]), name


def test_the_deployed_model_is_the_global_layers_with_the_devices_own_batchnorm(datas) -> None:
    # Prepare
    server, devices = make_server(), make_devices(datas)
    play_round(server, devices, 1)
    device = devices["dev1"]
    deployed = build_model("cnn8", DIGITS, seed=SETTINGS.seed)
    own = own_batchnorm(device)
    deployed.load_state_dict({**{k: torch.from_numpy(v) for k, v in server.state["shared"].items()}, **own})

    # Execute
    metrics = device.evaluate(Task(1, server.eval_groups(), {"final": True}))

    # Assert
    deployed.eval()
    with torch.no_grad():
        predicted = deployed(device.test_x).argmax(dim=1)
    assert metrics["accuracy"] == pytest.approx(float((predicted == device.test_y).float().mean()))
    assert "global_accuracy" not in metrics


def test_dp_sgd_refuses_fedbn_on_a_model_with_batchnorm_naming_the_layer() -> None:
    with pytest.raises(DpSgdRefused, match=r"refused for this model: its module 'body\.\d+' \(BatchNorm2d\)"):
        check_dp_sgd(FedBNDevice, build_model("cnn8", DIGITS, seed=0))
