"""Unit tests for the baselines local, fedavg_ft, fedprox, fedper, fedrep and lg_fedavg.

Device and server classes are driven directly (no broker) on the digits data of a few clients:
what goes over the wire in both directions, the server average, and each algorithm's mechanics
(FedProx's proximal gradient, FedRep's head/body phases, FedAvg+FT's fine-tuning on a copy).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import pytest
import torch

from builtin_tasks import DIGITS, digits_client
from coordinator.algorithms import load as load_server
from coordinator.algorithms.base import ServerContext
from coordinator.rounds.inprocess import play_round
from edge_sdk import wire
from edge_sdk.settings import TrainSettings
from edge_sdk.algorithms import load as load_device
from edge_sdk.algorithms.base import DeviceAlgorithm, Task
from edge_sdk.algorithms.hyper.fedavg_ft import Hyper as FedAvgFTHyper
from edge_sdk.algorithms.hyper.fedprox import Hyper as FedProxHyper
from edge_sdk.algorithms.hyper.fedrep import Hyper as FedRepHyper
from edge_sdk.algorithms.part_sharing import SHARED, PartSharingDevice
from edge_sdk.config import ConfigError, from_mapping
from edge_sdk.data import ClientData
from edge_sdk.params import part_of
from edge_sdk.protocol import Envelope, Kind
from edge_sdk.training import batches, cross_entropy_loss, recalibrate_batchnorm, run_epochs

BASELINES = ("local", "fedavg_ft", "fedprox", "fedper", "fedrep", "lg_fedavg")
SHARED_PARTS = {
    "local": set(),
    "fedavg_ft": {"body", "head"},
    "fedprox": {"body", "head"},
    "fedper": {"body"},
    "fedrep": {"body"},
    "lg_fedavg": {"head"},
}
GLOBAL_MODEL = {"fedavg_ft", "fedprox"}  # algorithms that report global_accuracy
STATISTIC_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")
FAST = {"fedrep": {"head_epochs": 1}, "fedavg_ft": {"ft_epochs": 1}}  # for the wire-level tests
NUM_CLIENTS = 3
MAX_TRAIN, MAX_TEST = 96, 48
SETTINGS = TrainSettings(model="cnn8", rounds=2, local_epochs=1, batch_size=32, lr=0.05, seed=0)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def datas() -> list[ClientData]:
    """The first examples of each of 3 digits clients (dirichlet, seed 0), to keep the tests fast."""
    parts = [
        digits_client(i, num_clients=NUM_CLIENTS, partition="dirichlet", seed=0)
        for i in range(NUM_CLIENTS)
    ]
    return [
        dataclasses.replace(d, train_x=d.train_x[:MAX_TRAIN], train_y=d.train_y[:MAX_TRAIN],
                            test_x=d.test_x[:MAX_TEST], test_y=d.test_y[:MAX_TEST])
        for d in parts
    ]


def make_server(algorithm_id: str, **hyper):
    cls = load_server(algorithm_id)
    context = ServerContext("cnn8", DIGITS, seed=0, rounds=SETTINGS.rounds, clients=NUM_CLIENTS)
    return cls(from_mapping(cls.Hyper, hyper), context)


def make_device(algorithm_id: str, data: ClientData, index: int = 0, **hyper) -> PartSharingDevice:
    cls = load_device(algorithm_id)
    return cast(PartSharingDevice, cls(from_mapping(cls.Hyper, hyper), SETTINGS, data, "cpu", client_seed=1000 + index))


def fleet(devices: Sequence[DeviceAlgorithm]) -> dict[str, DeviceAlgorithm]:
    """The devices by the ids the coordinator would give them."""
    return {f"dev{i:03d}": device for i, device in enumerate(devices)}


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# -- what goes over the wire, for every baseline -------------------------------------------------
@pytest.mark.parametrize("algorithm_id", BASELINES)
def test_uploads_carry_exactly_the_shared_parts_and_never_a_personal_key(algorithm_id, datas) -> None:
    # Prepare
    server = make_server(algorithm_id, **FAST.get(algorithm_id, {}))
    devices = [make_device(algorithm_id, d, i, **FAST.get(algorithm_id, {})) for i, d in enumerate(datas)]

    # Execute
    rounds = [play_round(server, fleet(devices), r).results.values() for r in (1, 2)]

    # Assert
    device = devices[0]
    state_keys = set(device.model.state_dict())
    personal = set(device.partition.personal)
    shared = set(device.partition.shared)
    assert personal and personal | shared == state_keys and not personal & shared
    assert {part_of(k) for k in shared} == SHARED_PARTS[algorithm_id]
    assert not {k for k in shared if k.endswith(STATISTIC_SUFFIXES)}
    for results in rounds:
        for result in results:
            uploaded = {name for group in result.groups.values() for name in group}
            assert uploaded == shared
            payload = wire.encode(Envelope(Kind.TRAIN_RES, "dev000", groups=result.groups, metrics=result.metrics))
            assert [k for k in personal if k.encode() in payload] == []
    assert {g: set(a) for g, a in server.update_spec(3).items()} == ({SHARED: shared} if shared else {})


@pytest.mark.parametrize("algorithm_id", [a for a in BASELINES if a != "local"])
def test_server_state_is_the_example_weighted_mean_of_the_uploads(algorithm_id, datas) -> None:
    # Prepare
    server = make_server(algorithm_id, **FAST.get(algorithm_id, {}))
    devices = [make_device(algorithm_id, d, i, **FAST.get(algorithm_id, {})) for i, d in enumerate(datas)]

    # Execute
    played = play_round(server, fleet(devices), 1)

    # Assert
    results = played.results.values()
    weights = np.array([r.metrics["num_examples"] for r in results], dtype=np.float64)
    assert list(played.weights.values()) == list(weights)
    for name, value in server.state[SHARED].items():
        expected = sum(w * r.groups[SHARED][name] for w, r in zip(weights, results, strict=True)) / weights.sum()
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("algorithm_id", BASELINES)
def test_evaluation_deploys_the_global_shared_parts_with_the_personal_ones(algorithm_id, datas) -> None:
    # Prepare
    server = make_server(algorithm_id, **FAST.get(algorithm_id, {}))
    devices = [make_device(algorithm_id, d, i, **FAST.get(algorithm_id, {})) for i, d in enumerate(datas[:2])]
    play_round(server, fleet(devices), 1)

    # Execute
    metrics = [d.evaluate(Task(1, server.eval_groups(), {"final": True})) for d in devices]

    # Assert
    for device, m in zip(devices, metrics, strict=True):
        assert 0.0 <= m["accuracy"] <= 1.0 and m["num_test"] == device.data.num_test
        assert ("global_accuracy" in m) == (algorithm_id in GLOBAL_MODEL)
        state = device.model.state_dict()
        for name, value in server.state.get(SHARED, {}).items():
            np.testing.assert_array_equal(state[name].numpy(), value)
    personal_differs = [
        not np.array_equal(devices[0].personal_state()[k], devices[1].personal_state()[k])
        for k in devices[0].partition.personal if not k.endswith("num_batches_tracked")
    ]
    assert all(personal_differs)


def test_server_hyperparameters_are_the_devices(datas) -> None:
    for algorithm_id in BASELINES:
        assert load_server(algorithm_id).Hyper is load_device(algorithm_id).Hyper


def test_hyperparameter_defaults_follow_the_spec() -> None:
    assert cast(FedProxHyper, load_device("fedprox").Hyper()).mu == 0.01
    assert cast(FedAvgFTHyper, load_device("fedavg_ft").Hyper()).ft_epochs == 10
    fedrep = cast(FedRepHyper, load_device("fedrep").Hyper())
    assert (fedrep.head_epochs, fedrep.body_epochs, fedrep.lr, fedrep.momentum) == (10, None, None, 0.5)
    assert cast(FedProxHyper, from_mapping(load_device("fedprox").Hyper, {"mu": "0.5"})).mu == 0.5


# -- local ----------------------------------------------------------------------------------------
def test_local_sends_no_arrays_in_either_direction(datas) -> None:
    # Prepare
    server = make_server("local")
    device = make_device("local", datas[0])
    before = parameters(device.model)

    # Execute
    result = device.fit(Task(1, server.task_groups(1), {}))
    train = wire.encode(Envelope(Kind.TRAIN, "coordinator", groups=server.task_groups(1)))
    metrics = device.evaluate(Task(1, server.eval_groups(), {"final": True}))

    # Assert
    assert server.state == {} and server.update_spec(1) == {} and server.eval_groups() == {}
    assert result.groups == {} and result.metrics["num_examples"] == datas[0].num_train
    assert wire.decode(train).groups == {}
    assert any(not torch.equal(before[k], p) for k, p in device.model.named_parameters())
    assert metrics["accuracy"] == device.test_accuracy(device.model)
    assert "global_accuracy" not in metrics


# -- fedprox --------------------------------------------------------------------------------------
def test_fedprox_proximal_term_adds_exactly_mu_times_the_distance_to_the_global_model(datas) -> None:
    # Prepare: two devices from the same start, the global model loaded, then the same drift away
    mu = 0.5
    server = make_server("fedprox")
    task = Task(1, server.task_groups(1), {})
    prox, plain = make_device("fedprox", datas[0], mu=mu), make_device("fedprox", datas[0], mu=0.0)
    drift = {name: 0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
             for i, (name, p) in enumerate(prox.model.named_parameters())}
    grads = {}
    for device in (prox, plain):
        device.load_shared(task)
        loss_fn = device.local_loss(task)
        with torch.no_grad():
            for name, p in device.model.named_parameters():
                p.add_(drift[name])
        device.model.train()

        # Execute
        device.model.zero_grad()
        loss_fn(device.train_x[:32], device.train_y[:32]).backward()
        grads[device] = {name: cast(torch.Tensor, p.grad).clone() for name, p in device.model.named_parameters()}

    # Assert
    for name in grads[prox]:
        difference = grads[prox][name] - grads[plain][name]
        torch.testing.assert_close(difference, mu * drift[name], rtol=1e-4, atol=1e-6)


# -- fedrep ---------------------------------------------------------------------------------------
def spy_on_optimizers(device: PartSharingDevice, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Record, for each optimizer the device builds, its parameter names and its number of steps."""
    names = {id(p): n for n, p in device.model.named_parameters()}
    made: list[dict] = []
    build = device.optimizer

    def optimizer(params=None):
        opt = build(params)
        record: dict[str, Any] = {"params": {names[id(p)] for g in opt.param_groups for p in g["params"]}, "steps": 0}
        step = opt.step

        def counted_step(*args, **kwargs):
            record["steps"] += 1
            return step(*args, **kwargs)

        monkeypatch.setattr(opt, "step", counted_step)
        made.append(record)
        return opt

    monkeypatch.setattr(device, "optimizer", optimizer)
    return made


def test_fedrep_trains_the_head_then_the_body_for_their_epochs(datas, monkeypatch) -> None:
    # Prepare
    device = make_device("fedrep", datas[0], head_epochs=3, body_epochs=2)
    made = spy_on_optimizers(device, monkeypatch)
    head = {n for n, _ in device.model.named_parameters() if part_of(n) == "head"}
    body = {n for n, _ in device.model.named_parameters() if part_of(n) == "body"}
    per_epoch = len(list(batches(datas[0].num_train, SETTINGS.batch_size, shuffle=False)))

    # Execute
    device.fit(Task(1, make_server("fedrep").task_groups(1), {}))

    # Assert
    assert made == [{"params": head, "steps": 3 * per_epoch}, {"params": body, "steps": 2 * per_epoch}]
    assert all(p.requires_grad for p in device.model.parameters())


@pytest.mark.parametrize(("head_epochs", "body_epochs", "changed"), [(1, 0, "head"), (0, 1, "body")])
def test_fedrep_phase_leaves_the_frozen_part_unchanged(datas, head_epochs, body_epochs, changed) -> None:
    # Prepare
    server = make_server("fedrep")
    device = make_device("fedrep", datas[0], head_epochs=head_epochs, body_epochs=body_epochs)
    device.load_shared(Task(1, server.task_groups(1), {}))
    before = parameters(device.model)

    # Execute
    device.fit(Task(1, server.task_groups(1), {}))

    # Assert
    moved = {part_of(n) for n, p in device.model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert moved == {changed}


def test_head_phase_fits_the_head_on_the_features_the_deployed_body_computes(datas) -> None:
    # Prepare: a trained body whose BatchNorm statistics are stale (reset), and the same head
    # fitted by hand on the features of the body recalibrated on the train split, in eval mode
    server = make_server("fedrep")
    device = make_device("fedrep", datas[0])
    play_round(server, fleet([device]), 1)
    for module in device.model.body.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.reset_running_stats()
    reference = copy.deepcopy(device.model)
    recalibrate_batchnorm(reference.body, device.train_x)
    with torch.no_grad():
        features = reference.body.eval()(device.train_x)
    run_epochs(cross_entropy_loss(reference.head.train()), device.optimizer(reference.head.parameters()), features,
               device.train_y, epochs=2, batch_size=SETTINGS.batch_size, generator=device.generator(7))
    body_before = parameters(device.model.body)

    # Execute
    device.train_head_on_features(device.model, 2, device.generator(7))

    # Assert: the same head, an untouched body, statistics of the train split
    for name, value in device.model.head.state_dict().items():
        torch.testing.assert_close(value, reference.head.state_dict()[name])
    for name, value in device.model.body.named_parameters():
        assert torch.equal(value.detach(), body_before[name])
    for name, value in device.model.body.state_dict().items():
        torch.testing.assert_close(value, reference.body.state_dict()[name])


def test_fedrep_body_epochs_default_to_the_runs_local_epochs(datas, monkeypatch) -> None:
    # Prepare
    device = make_device("fedrep", datas[0], head_epochs=0)
    made = spy_on_optimizers(device, monkeypatch)
    per_epoch = len(list(batches(datas[0].num_train, SETTINGS.batch_size, shuffle=False)))

    # Execute
    device.fit(Task(1, make_server("fedrep").task_groups(1), {}))

    # Assert
    assert [m["steps"] for m in made] == [SETTINGS.local_epochs * per_epoch]  # no head phase


def test_fedrep_optimizer_takes_its_own_lr_and_momentum_when_set(datas) -> None:
    default = make_device("fedrep", datas[0]).optimizer().param_groups[0]
    tuned = make_device("fedrep", datas[0], lr=0.01, momentum=0.9).optimizer().param_groups[0]
    assert (default["lr"], default["momentum"]) == (SETTINGS.lr, 0.5)
    assert (tuned["lr"], tuned["momentum"]) == (0.01, 0.9)


@pytest.mark.parametrize("bad", [{"momentum": "1.0"}, {"lr": "0"}, {"head_epochs": "-1"}])
def test_fedrep_rejects_bad_hyperparameters_naming_them(bad) -> None:
    with pytest.raises(ConfigError, match=next(iter(bad))):
        from_mapping(load_device("fedrep").Hyper, bad, where="fedrep")


# -- new clients of fedper and fedrep ---------------------------------------------------------------
@pytest.mark.parametrize(("algorithm_id", "hyper", "head_epochs"),
                         [("fedper", {}, 10), ("fedrep", {"head_epochs": 3}, 3)])
def test_a_new_client_fits_its_head_on_the_frozen_global_body_before_it_is_scored(
        algorithm_id, hyper, head_epochs, datas) -> None:
    # Prepare: devices 0 and 1 train a round; device 2 never does (a held-out device), and a
    # twin of it gets the expected head by hand
    server = make_server(algorithm_id, **hyper)
    play_round(server, fleet([make_device(algorithm_id, d, i, **hyper) for i, d in enumerate(datas[:2])]), 1)
    new_client, reference = (make_device(algorithm_id, datas[2], 2, **hyper) for _ in range(2))
    task = Task(1, server.eval_groups(), {"final": True})
    reference.load_shared(task)
    reference.train_head_on_features(reference.model, head_epochs, reference.generator(1))
    untrained_head = {k: v.clone() for k, v in new_client.model.head.state_dict().items()}

    # Execute
    metrics = new_client.evaluate(task)

    # Assert: the head moved from its initialization to the reference's; the body is the global one
    assert metrics["accuracy"] == reference.test_accuracy(reference.model)
    for name, value in new_client.model.state_dict().items():
        torch.testing.assert_close(value, reference.model.state_dict()[name])
    assert not all(torch.equal(v, untrained_head[k]) for k, v in new_client.model.head.state_dict().items())
    for name, value in server.state[SHARED].items():
        np.testing.assert_array_equal(new_client.model.state_dict()[name].numpy(), value)


@pytest.mark.parametrize("algorithm_id", ["fedper", "fedrep"])
def test_a_device_that_has_trained_is_scored_with_its_head_as_it_is(algorithm_id, datas) -> None:
    # Prepare
    server = make_server(algorithm_id, **FAST.get(algorithm_id, {}))
    device = make_device(algorithm_id, datas[0], **FAST.get(algorithm_id, {}))
    play_round(server, fleet([device]), 1)
    personal = device.personal_state()

    # Execute
    device.evaluate(Task(1, server.eval_groups(), {"final": True}))

    # Assert
    for name, value in device.personal_state().items():
        np.testing.assert_array_equal(value, personal[name])


# -- fedavg_ft ------------------------------------------------------------------------------------
def test_fedavg_ft_fine_tunes_the_head_of_a_copy_and_leaves_training_state_alone(datas, monkeypatch) -> None:
    # Prepare: twin devices; only one evaluates (and fine-tunes) between the rounds
    server = make_server("fedavg_ft")
    evaluated, twin = make_device("fedavg_ft", datas[0], ft_epochs=3), make_device("fedavg_ft", datas[0], ft_epochs=3)
    play_round(server, fleet([evaluated]), 1)
    twin.fit(Task(1, make_server("fedavg_ft").task_groups(1), {}))
    calls = []
    train_head = evaluated.train_head_on_features

    def recorded(model, epochs, gen):
        calls.append((model, epochs))
        return train_head(model, epochs, gen)

    monkeypatch.setattr(evaluated, "train_head_on_features", recorded)

    # Execute
    metrics = evaluated.evaluate(Task(1, server.eval_groups(), {"final": False}))
    global_accuracy = evaluated.test_accuracy(evaluated.model)
    after = [d.fit(Task(2, server.task_groups(2), {})) for d in (evaluated, twin)]

    # Assert
    assert [epochs for _, epochs in calls] == [3]
    assert calls[0][0] is not evaluated.model
    assert metrics["global_accuracy"] == global_accuracy
    for name, value in after[0].groups[SHARED].items():
        np.testing.assert_array_equal(value, after[1].groups[SHARED][name])
    for name, value in evaluated.personal_state().items():
        np.testing.assert_array_equal(value, twin.personal_state()[name])


def test_fedavg_ft_without_fine_tuning_reports_the_global_model(datas) -> None:
    # Prepare
    server = make_server("fedavg_ft")
    device = make_device("fedavg_ft", datas[1], ft_epochs=0)
    play_round(server, fleet([device]), 1)

    # Execute
    metrics = device.evaluate(Task(1, server.eval_groups(), {"final": True}))

    # Assert
    assert metrics["accuracy"] == metrics["global_accuracy"]
