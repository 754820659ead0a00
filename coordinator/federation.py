"""A whole federation from Python, with your own model and data: `Federation(...).run()`.

The broker (the embedded amqtt unless `broker` names one), the coordinator and every device run
in this process, each device an `EdgeClient` (or, for `lite_fraction`, a weak `LiteClient`)
thread with its own MQTT connection, the trainers taking turns to compute. So a model factory or
a training step written in a script or a notebook (a closure, a lambda) is used as it is:
nothing is pickled or imported by path. `edgepfl simulate` runs the same federation with its
devices in worker processes, where a model is named by an import path; both start and stop the
broker, devices and coordinator the same way (coordinator/hosting/lifecycle.py).

    report = Federation(model=my_factory, data="sensor.csv", algorithm="fedrep", clients=10,
                        rounds=5).run()
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any
from collections.abc import Callable

import numpy as np

from edge_sdk.config import ConfigError
from edge_sdk.data import TaskSpec
from edge_sdk.data.resolve import TASK_FIELDS
from edge_sdk.models import ModelSpec, model_name
from edge_sdk.session import DeviceSession

from .config.run_config import RunConfig
from .hosting.device_ranges import client_id_for
from .hosting.lifecycle import LocalFederation
from .run.folder import RunFolder
from .server import Coordinator

ARRAYS_FILE = "data.npz"
"""Where the run folder keeps data given as arrays, so the run reads it as any data file."""


def spec_name(model: ModelSpec) -> str:
    """The `model` setting of a run trained with `model`: a spec string as it is, a factory's
    import path `module:qualname` (names of nested functions made identifier-safe)."""
    name = model_name(model)
    if isinstance(model, str):
        return name
    module, _, qualname = name.partition(":")
    return f"{module}:{re.sub(r'[^A-Za-z0-9_.]', '', qualname).strip('.') or 'factory'}"


def declared_task(task: TaskSpec | dict | None) -> dict | None:
    """A `[task]` table from a TaskSpec (all it declares) or a dict (as given)."""
    if isinstance(task, TaskSpec):
        plain = task.to_plain()
        return {key: plain[key] for key in TASK_FIELDS}
    return task


class Federation:
    """A federated run of `model` on `data` (a file: .npz, .csv, image folder; or `(x, y)`
    arrays) or a built-in `dataset`, with any setting of `edgepfl simulate` as a keyword by its
    flat key (`algorithm`, `clients`, `rounds`, `partition`, `alpha`, `out`, `broker`, ...).

    `model` is a factory `factory(task) -> nn.Module` (or a built-in name or import path);
    `task` declares what the data cannot say (a TaskSpec or a `[task]`-style dict); `optimizer`
    and `loss` replace the trainers' local step where the algorithm allows it; `on_round`
    receives each round's record."""

    def __init__(self, *, model: ModelSpec = "auto", data: str | Path | tuple[np.ndarray, np.ndarray] | None = None,
                 dataset: str | None = None, task: TaskSpec | dict | None = None,
                 optimizer: Callable | None = None, loss: Callable | None = None,
                 on_round: Callable[[dict[str, Any]], None] | None = None, **settings: Any):
        self.model = model
        self.arrays = data if isinstance(data, tuple) else None
        source: dict[str, Any] = ({"data": str(data)} if isinstance(data, (str, Path))
                                  else {"dataset": dataset} if dataset else {})
        self.config = RunConfig.of(**source, **settings, model=spec_name(model), declared_task=declared_task(task))
        self.folder = RunFolder(self.config.run.out)
        if self.arrays is not None:  # read back from the run folder, as any data file
            self.config = self.config.replace(data=str(self.folder.path / ARRAYS_FILE))
        self.optimizer, self.loss = optimizer, loss
        self.on_round = on_round

    def run(self) -> dict[str, Any]:
        """Train and evaluate; returns the report (also written to the run folder)."""
        if self.config.local_shards:
            raise ConfigError(
                "local_aggregators: a Federation hosts no shard aggregators, so with "
                f"shards={self.config.round.shards} set local_aggregators='none', broker and federation, and start "
                "`edgepfl aggregator --shard k/K` beside it (or run `edgepfl simulate --shards K`, which hosts them)")
        if self.arrays is not None:
            self.folder.path.mkdir(parents=True, exist_ok=True)
            x, y = self.arrays
            np.savez(self.folder.path / ARRAYS_FILE, x=np.asarray(x), y=np.asarray(y))
        with LocalFederation(self.config, "py") as local:
            config = local.config.replace(broker=local.url)  # the devices and the coordinator read it there
            devices = self._devices(config, local.url)
            local.host(lambda: DeviceThreads(devices))
            return local.run_coordinator(lambda channel: Coordinator(
                config, channel, on_round=self.on_round, model=None if isinstance(self.model, str) else self.model,
                expected_devices=[client_id_for(i) for i in range(config.run.clients)],
                partition=config.run.partition))

    def _devices(self, config: RunConfig, url: str) -> list[DeviceSession]:
        """The run's devices, reaching the broker at `url`: trainers with the model and training
        step, the last `lite_fraction` of them weak devices."""
        from edge_sdk.client import EdgeClient
        from edge_sdk.lite import LiteClient

        lock = threading.Lock()
        first_lite = config.run.clients - config.lite_devices
        keys: dict[str, Any] = {}
        if config.secagg.secure_aggregation:  # every device enrolled, its identity key in its state folder
            from edge_sdk.secagg.device import SecAggKeys
            from edge_sdk.secagg.enroll import enroll

            fleet = [client_id_for(i) for i in range(config.run.clients)]
            enroll(fleet, self.folder.device_identity, self.folder.secagg_roster)
            keys = {device: SecAggKeys.load(self.folder.device_identity(device), self.folder.secagg_roster)
                    for device in fleet}
        devices: list[DeviceSession] = []
        for index in range(config.run.clients):
            client_id = client_id_for(index)
            data = config.run.client_data(index, config.training.seed, config.declared_task)
            session: dict[str, Any] = {"broker": config.mqtt_settings(url, account=client_id),
                       "federation": config.broker.federation, "state_dir": self.folder.device_state(client_id)}
            if index >= first_lite:
                devices.append(LiteClient(client_id, data, head=config.simulation.head, secagg_keys=keys.get(client_id),
                                          model_path=self.folder.device_model(client_id), **session))
            else:
                devices.append(EdgeClient(client_id, data, device=config.simulation.device, compute_lock=lock,
                                          model=self.model if not isinstance(self.model, str) else None,
                                          optimizer=self.optimizer, loss=self.loss,
                                          secagg_keys=keys.get(client_id), **session))
        return devices


class DeviceThreads:
    """A Federation's devices, one thread each, started on creation; `stop` tells them to leave."""

    def __init__(self, devices: list[DeviceSession]):
        self.leave = threading.Event()
        self.threads = [threading.Thread(target=device.run, args=(self.leave,), name=device.client_id, daemon=True)
                        for device in devices]
        for thread in self.threads:
            thread.start()

    def join(self, timeout: float | None = None) -> None:
        for thread in self.threads:
            thread.join(timeout)

    def stop(self) -> None:
        self.leave.set()
