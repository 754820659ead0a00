"""The run's `optimizer` setting: with "sgd" every local training phase of every algorithm (head-only
phases and evaluation-time fine-tuning included) trains with one SGD at the run's lr, momentum
and weight decay; with "paper" (the default) each algorithm keeps its own optimizer.

Every optimizer built while a device trains a round (with the algorithm's server) and is
evaluated is recorded at `torch.optim.Optimizer.__init__`, so a phase that built its own
optimizer without asking `TorchDevice.local_optimizer` is seen too.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from builtin_tasks import digits_client
from coordinator.algorithms import load as load_server
from coordinator.algorithms.base import ServerContext
from coordinator.rounds.inprocess import play_round
from edge_sdk.algorithms import ALGORITHM_IDS
from edge_sdk.algorithms import load as load_device
from edge_sdk.algorithms.base import Task, TrainingStepRefused
from edge_sdk.config import from_mapping
from edge_sdk.settings import TrainSettings

SETTINGS = TrainSettings(model="cnn8", rounds=2, local_epochs=1, batch_size=32, lr=0.037, seed=0)
COMMON = dataclasses.replace(SETTINGS, optimizer="sgd", sgd_momentum=0.6, sgd_weight_decay=0.002)
FAST = {"fedrep": {"head_epochs": 1}, "fedavg_ft": {"ft_epochs": 1}, "repper": {"head_epochs": 1}}
"""One epoch for the head phases: they still build their optimizer."""


def sgd(lr: float, momentum: float, weight_decay: float = 0.0, nesterov: bool = False) -> tuple:
    return ("SGD", lr, momentum, weight_decay, nesterov)


DEFAULT = {sgd(0.037, 0.9)}
"""The optimizer of every algorithm without one of its own: SGD at the run's lr, momentum 0.9."""
OWN = {
    "fedrep": {sgd(0.037, 0.5)},
    "dualfed": {sgd(0.01, 0.5)},
    "cd2_pfed": {sgd(0.037, 0.9, 5e-4, nesterov=True)},
    "repper": {("Adam", 1e-3, None, 1e-4, None), sgd(0.037, 0.9)},
}
"""The local optimizers (type, lr, momentum, weight decay, Nesterov) at lr 0.037 of the algorithms
that have their own; every other algorithm trains with `DEFAULT`."""


@pytest.fixture(scope="module")
def data():
    d = digits_client(0, num_clients=3, partition="dirichlet", seed=0)
    return dataclasses.replace(d, train_x=d.train_x[:64], train_y=d.train_y[:64], test_x=d.test_x[:32],
                               test_y=d.test_y[:32])


class Recorder:
    """(type, lr, momentum, weight decay, nesterov) of every optimizer built inside `device(...)`
    calls: the device's local work, not the server's (DC-PFL's server calibrates with SGD of its own)."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []
        self.active = False

    def device(self, method):
        def recorded(*args):
            self.active = True
            try:
                return method(*args)
            finally:
                self.active = False

        return recorded


@pytest.fixture
def built(monkeypatch) -> Recorder:
    recorder = Recorder()
    original = torch.optim.Optimizer.__init__

    def recording(self, params, defaults):
        if recorder.active:
            recorder.seen.append((type(self).__name__, defaults["lr"], defaults.get("momentum"),
                                  defaults["weight_decay"], defaults.get("nesterov")))
        original(self, params, defaults)

    monkeypatch.setattr(torch.optim.Optimizer, "__init__", recording)
    return recorder


def train_and_evaluate(algorithm_id: str, settings: TrainSettings, data, recorder: Recorder,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    """One round of `algorithm_id` with its server and one device, then the device's evaluation."""
    server_cls, device_cls = load_server(algorithm_id), load_device(algorithm_id)
    server = server_cls(from_mapping(server_cls.Hyper, FAST.get(algorithm_id, {})),
                        ServerContext("cnn8", data.task, seed=0, rounds=settings.rounds, clients=1))
    device = device_cls(from_mapping(device_cls.Hyper, FAST.get(algorithm_id, {})), settings, data, "cpu",
                        client_seed=7, assignment=server.assignment("dev0"))
    monkeypatch.setattr(device, "fit", recorder.device(device.fit))
    play_round(server, {"dev0": device}, 1)
    recorder.device(device.evaluate)(Task(1, server.eval_groups(), {}))


@pytest.mark.parametrize("algorithm_id", ALGORITHM_IDS)
def test_sgd_mode_trains_every_local_phase_with_the_runs_sgd(algorithm_id, data, built, monkeypatch) -> None:
    # Execute
    train_and_evaluate(algorithm_id, COMMON, data, built, monkeypatch)

    # Assert: at least one optimizer, and every one is the run's SGD
    assert built.seen, "no optimizer was built"
    assert set(built.seen) == {sgd(0.037, 0.6, 0.002)}


@pytest.mark.parametrize("algorithm_id", ALGORITHM_IDS)
def test_paper_mode_keeps_each_algorithms_own_optimizer(algorithm_id, data, built, monkeypatch) -> None:
    # Execute
    train_and_evaluate(algorithm_id, SETTINGS, data, built, monkeypatch)

    # Assert
    assert set(built.seen) == OWN.get(algorithm_id, DEFAULT)


def test_every_algorithm_with_its_own_optimizer_is_a_known_id() -> None:
    assert set(OWN) <= set(ALGORITHM_IDS), f"OWN names unknown ids: {sorted(set(OWN) - set(ALGORITHM_IDS))}"


def test_a_trainers_own_optimizer_is_refused_in_sgd_mode(data) -> None:
    cls = load_device("fedavg")
    with pytest.raises(TrainingStepRefused, match='optimizer = "sgd"'):
        cls(cls.Hyper(), COMMON, data, "cpu", client_seed=7,
            optimizer=lambda params, settings: torch.optim.Adam(params, lr=settings.lr))


@pytest.mark.parametrize(("values", "key"), [
    ({"optimizer": "adam"}, "optimizer"),
    ({"optimizer": "sgd", "sgd_momentum": 1.0}, "sgd_momentum"),
    ({"optimizer": "sgd", "sgd_weight_decay": -0.1}, "sgd_weight_decay"),
    ({"sgd_momentum": 0.5}, "sgd_momentum"),  # the paper optimizers take no run-level momentum
])
def test_a_bad_optimizer_setting_names_its_key(values, key) -> None:
    with pytest.raises(ValueError, match=f"^{key} must be"):
        dataclasses.replace(SETTINGS, **values)
