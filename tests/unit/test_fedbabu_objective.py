"""FedBABU against Oh et al. (ICLR 2022): during federated training the local objective is the
cross-entropy of the whole network minimized over the body alone, the head being the random
initialization of the run's seed, the same on every device and never updated; the body is
averaged, w = sum_k (n_k / n) w_k; at evaluation each device fine-tunes the whole model (body
and head) for tau_f = `finetune_epochs` on its training split and is scored with the result.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from builtin_tasks import DIGITS, digits_client
from coordinator.algorithms import load as load_server
from coordinator.algorithms.base import ServerContext
from coordinator.rounds.inprocess import play_round
from edge_sdk.algorithms.base import Task
from edge_sdk.algorithms.fedbabu import FedBABUDevice
from edge_sdk.algorithms.hyper.fedbabu import Hyper
from edge_sdk.models import build_model, statistics_keys
from edge_sdk.settings import TrainSettings
from edge_sdk.training import batches, run_epochs
from objectives import assert_same_objective, cross_entropy, snapshot, tiny_batch

NUM_CLIENTS, FINETUNE = 3, 2
SETTINGS = TrainSettings(model="cnn8", rounds=3, local_epochs=2, batch_size=32, lr=0.05, seed=4)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def datas():
    """Three dirichlet digits clients, cut to different sizes so that the weights n_k / n differ."""
    parts = [digits_client(i, num_clients=NUM_CLIENTS, partition="dirichlet", seed=0) for i in range(NUM_CLIENTS)]
    return [dataclasses.replace(d, train_x=d.train_x[:size], train_y=d.train_y[:size], test_x=d.test_x[:48],
                                test_y=d.test_y[:48]) for d, size in zip(parts, (96, 64, 40), strict=True)]


def make_server():
    cls = load_server("fedbabu")
    return cls(Hyper(finetune_epochs=FINETUNE),
               ServerContext("cnn8", DIGITS, seed=SETTINGS.seed, rounds=SETTINGS.rounds, clients=NUM_CLIENTS))


def make_device(data, index: int = 0, settings: TrainSettings = SETTINGS) -> FedBABUDevice:
    return FedBABUDevice(Hyper(finetune_epochs=FINETUNE), settings, data, "cpu", client_seed=700 + index)


def make_devices(datas) -> dict[str, FedBABUDevice]:
    return {f"dev{i}": make_device(d, i) for i, d in enumerate(datas)}


def part(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k.startswith(prefix)}


def spy_on_optimizers(device: FedBABUDevice, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Record, for each optimizer the device builds, its parameter names and its number of steps."""
    names = {id(p): n for n, p in device.model.named_parameters()}
    made: list[dict] = []
    build = device.optimizer

    def optimizer(params=None):
        opt = build(params)
        params_of = [p for g in opt.param_groups for p in g["params"]]
        record: dict[str, Any] = {"params": {names.get(id(p), "copy." + str(i)) for i, p in enumerate(params_of)},
                                  "count": len(params_of), "steps": 0}
        step = opt.step

        def counted_step(*args, **kwargs):
            record["steps"] += 1
            return step(*args, **kwargs)

        monkeypatch.setattr(opt, "step", counted_step)
        made.append(record)
        return opt

    monkeypatch.setattr(device, "optimizer", optimizer)
    return made


def test_the_head_is_the_run_seeds_initialization_on_every_device(datas) -> None:
    # Prepare
    reference = build_model("cnn8", DIGITS, seed=SETTINGS.seed).head.state_dict()
    other_seed = build_model("cnn8", DIGITS, seed=SETTINGS.seed + 1).head.state_dict()

    # Execute
    heads = [device.model.head.state_dict() for device in make_devices(datas).values()]

    # Assert
    for head in heads:
        for key, value in reference.items():
            assert torch.equal(head[key], value), key
    assert any(not torch.equal(other_seed[k], v) for k, v in reference.items())


def test_local_training_leaves_the_head_bit_identical_and_trains_the_body(datas) -> None:
    # Prepare
    server, devices = make_server(), make_devices(datas)
    before = {cid: snapshot(device.model) for cid, device in devices.items()}

    # Execute: two rounds, every device trained and loaded with the global body
    for round_ in (1, 2):
        play_round(server, devices, round_)

    # Assert: every head element as it was initialized, identical across devices; every body parameter moved
    for cid, device in devices.items():
        after = snapshot(device.model)
        for key, value in part(before[cid], "head.").items():
            assert torch.equal(after[key], value), key
            assert torch.equal(after[key], snapshot(devices["dev0"].model)[key]), key
        for name, parameter in device.model.body.named_parameters():
            assert not torch.equal(parameter.detach(), before[cid][f"body.{name}"]), name


def test_the_local_optimizer_holds_the_body_alone_for_the_runs_epochs(datas, monkeypatch) -> None:
    # Prepare
    device = make_device(datas[0])
    made = spy_on_optimizers(device, monkeypatch)
    body = {n for n, _ in device.model.named_parameters() if n.startswith("body.")}
    per_epoch = len(list(batches(len(device.train_y), SETTINGS.batch_size, shuffle=False)))

    # Execute
    device.fit(Task(1, make_server().task_groups(1), {}))

    # Assert
    assert made == [{"params": body, "count": len(body), "steps": SETTINGS.local_epochs * per_epoch}]
    assert all(p.requires_grad for p in device.model.parameters())


def test_the_local_objective_is_the_cross_entropy_of_the_whole_network(datas) -> None:
    # Prepare: evaluation mode, so that BatchNorm is the same function in both passes
    device = make_device(datas[0])
    device.model.eval()
    x, y = tiny_batch(device.data, 8)
    loss = device.local_loss(Task(1, {}, {}))

    # Execute / Assert: value and gradient of every parameter (the head's too: it is frozen, not detached)
    assert_same_objective(lambda: loss(x, y), lambda: cross_entropy(device.model(x), y),
                          dict(device.model.named_parameters()))


def test_uploads_are_the_body_and_the_global_body_their_example_weighted_mean(datas) -> None:
    # Prepare
    server, devices = make_server(), make_devices(datas)
    model = devices["dev0"].model
    body = {k for k in model.state_dict() if k.startswith("body.")} - statistics_keys(model)

    # Execute
    played = play_round(server, devices, 1)

    # Assert
    n = {cid: float(len(devices[cid].train_y)) for cid in devices}
    for result in played.results.values():
        assert {key for group in result.groups.values() for key in group} == body
    (group,) = server.state.values()
    assert set(group) == body
    for key, value in group.items():
        expected = sum(n[cid] * played.results[cid].groups["shared"][key] for cid in devices) / sum(n.values())
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6)


def test_the_score_is_the_whole_model_fine_tuned_on_a_copy(datas, monkeypatch) -> None:
    # Prepare: a trained round; a reference fine-tunes body and head of the deployed model by hand
    server, devices = make_server(), make_devices(datas[:2])
    play_round(server, devices, 1)
    device = devices["dev1"]
    task = Task(1, server.eval_groups(), {"final": True})
    device.load_shared(task)
    kept = snapshot(device.model)
    global_model = build_model("cnn8", DIGITS, seed=SETTINGS.seed)
    global_model.load_state_dict(kept)
    reference = build_model("cnn8", DIGITS, seed=SETTINGS.seed)
    reference.load_state_dict(kept)
    reference.train()
    run_epochs(lambda xb, yb: F.cross_entropy(reference(xb), yb),
               torch.optim.SGD(reference.parameters(), lr=SETTINGS.lr, momentum=0.9), device.train_x, device.train_y,
               epochs=FINETUNE, batch_size=SETTINGS.batch_size, generator=device.generator(1), module=reference)
    made = spy_on_optimizers(device, monkeypatch)

    # Execute
    metrics = device.evaluate(task)

    # Assert: scored with the fine-tuned whole model; the global one reported beside it; the device's
    # own model (the fixed head above all) untouched
    def accuracy(model):
        model.eval()
        with torch.no_grad():
            return float((model(device.test_x).argmax(dim=1) == device.test_y).float().mean())

    per_epoch = len(list(batches(len(device.train_y), SETTINGS.batch_size, shuffle=False)))
    assert [(m["count"], m["steps"]) for m in made] == [(len(list(reference.parameters())), FINETUNE * per_epoch)]
    assert metrics["accuracy"] == pytest.approx(accuracy(reference))
    assert metrics["global_accuracy"] == pytest.approx(accuracy(global_model))
    for key, value in snapshot(device.model).items():
        assert torch.equal(value, kept[key]), key
    assert any(not torch.equal(v, kept[k]) for k, v in part(snapshot(reference), "head.").items())


def test_without_fine_tuning_the_score_is_the_global_model(datas) -> None:
    # Prepare
    server = make_server()
    device = FedBABUDevice(Hyper(finetune_epochs=0), SETTINGS, datas[0], "cpu", client_seed=9)
    play_round(server, {"dev0": device}, 1)

    # Execute
    metrics = device.evaluate(Task(1, server.eval_groups(), {"final": True}))

    # Assert
    assert metrics["accuracy"] == metrics["global_accuracy"]


def test_the_default_fine_tuning_is_the_papers_five_epochs() -> None:
    assert Hyper().finetune_epochs == 5
