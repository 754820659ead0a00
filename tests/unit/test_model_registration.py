"""A device whose model differs from the run's is refused at registration, by parameter name.

A device that brings a model of its own (`EdgeClient(model=...)`) describes it in HELLO and the
coordinator refuses a mismatch (reason `model_mismatch`, counted); a device that builds the
run's announced model checks it against the signature WELCOME carries (another version of the
model's package, other data). Either way the device stops with a message naming the first
parameter that differs, before any round. Over the in-memory loopback broker.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

from torch import nn

import user_models
from coordinator.config.run_config import RunConfig
from coordinator.server import Coordinator, RegistrationTimeout
from edge_sdk.channel import Channel
from edge_sdk.client import EdgeClient
from edge_sdk.data import ClientData, load_client_data
from edge_sdk.loopback import LoopbackBroker
from edge_sdk.models import split
from edge_sdk.protocol import Topics
from edge_sdk.session import RegistrationRefused

FED = "modelfed"
WAIT = 20.0


def wider_mlp(task):
    """The run's tiny_mlp with 48 hidden units instead of 32: `body.1.weight` differs."""
    return split(nn.Sequential(nn.Flatten(), nn.Linear(math.prod(task.input_shape), 48), nn.ReLU(),
                               nn.Linear(48, task.num_classes)), head="3")


class Run:
    """A 1-device FedAvg run on wine with `user_models:tiny_mlp` over the loopback broker, `changes` to its
    settings applied."""

    def __init__(self, tmp_path: Path, **changes):
        self.tmp_path = tmp_path
        self.broker = LoopbackBroker()
        self.config = RunConfig.of(algorithm="fedavg", dataset="wine", model="user_models:tiny_mlp", clients=1,
                                   rounds=1, local_epochs=1, federation=FED, out=str(tmp_path / "run"),
                                   registration_timeout=WAIT, device="cpu", **changes)
        transport = self.broker.transport("coordinator")
        transport.connect()
        self.coordinator = Coordinator(self.config, Channel(transport, Topics(FED)))

    def device(self, data, **options) -> tuple[EdgeClient, threading.Thread, list[BaseException]]:
        """Device dev000 running in a thread until it ends; what it raised is collected."""
        client = EdgeClient("dev000", data, federation=FED, device="cpu", state_dir=self.tmp_path / "dev000",
                            transport=self.broker.transport("dev000"), **options)
        errors: list[BaseException] = []

        def run() -> None:
            try:
                client.run()
            except RegistrationRefused as exc:
                errors.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return client, thread, errors

    def coordinate_in_background(self) -> None:
        """The coordinator waits for its device (and gives up after WAIT) in a daemon thread."""
        def run() -> None:
            try:
                self.coordinator.run()
            except RegistrationTimeout:
                pass

        threading.Thread(target=run, daemon=True).start()


def wine_client(index: int):
    return load_client_data("wine", num_clients=2, index=index, seed=0)


def test_a_device_with_another_model_of_its_own_is_refused_by_the_coordinator(tmp_path) -> None:
    # Prepare
    run = Run(tmp_path)
    _, device, errors = run.device(wine_client(0), model=wider_mlp)

    # Execute
    run.coordinate_in_background()
    device.join(WAIT)

    # Assert: refused by name, counted, never registered
    assert errors and "'body.1.weight'" in str(errors[0]), errors
    assert "[32, 13]" in str(errors[0]) and "[48, 13]" in str(errors[0])
    assert run.coordinator.channel.rejections.get("model_mismatch") == 1
    assert "dev000" not in run.coordinator.registry.devices


def test_a_device_with_the_same_model_of_its_own_trains_in_the_run(tmp_path) -> None:
    # Prepare
    run = Run(tmp_path)
    _, device, errors = run.device(wine_client(0), model=user_models.tiny_mlp)

    # Execute
    report = run.coordinator.run()
    device.join(WAIT)

    # Assert
    assert not errors
    assert report["rounds"][0]["participants"] == 1
    assert "model_mismatch" not in report["rejections"]


def test_a_device_whose_data_makes_another_model_refuses_to_join(tmp_path) -> None:
    # Prepare: the device's feature vectors have 12 features, the run's 13
    run = Run(tmp_path)
    data = wine_client(1)
    narrow = ClientData.from_arrays(data.train_x[:, :12], data.train_y, seed=0)
    client, device, errors = run.device(narrow)

    # Execute
    run.coordinate_in_background()
    device.join(WAIT)

    # Assert: the device stops before any round, naming the parameter
    assert errors and "differs from the coordinator's" in str(errors[0]), errors
    assert "'body.1.weight'" in str(errors[0])
    assert not client.joined


def test_a_device_refuses_a_dp_sgd_delta_of_one_over_its_examples_or_more_by_name(tmp_path) -> None:
    # Prepare: DP-SGD at delta 0.05, which a device of 20 examples or more cannot take
    run = Run(tmp_path, dp_sgd=True, dp_sgd_delta=0.05)
    data = wine_client(0)
    _, device, errors = run.device(data, model=user_models.tiny_mlp)

    # Execute
    run.coordinate_in_background()
    device.join(WAIT)

    # Assert
    assert data.num_train >= 20
    assert errors and "dp_sgd_delta (--dp-sgd-delta) 0.05 must be below 1 over the" in str(errors[0]), errors
