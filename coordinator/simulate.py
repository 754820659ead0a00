"""A whole federation on one machine, honestly over MQTT.

The broker (embedded amqtt unless `--broker` names one), the coordinator in this process, and
the devices in worker processes, each hosting several virtual devices with their own MQTT
connections. Devices in one worker take turns to compute (one lock per worker) so that the
workers, not the threads, use the cores.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import signal
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from edge_sdk.settings import BrokerSettings, TrainSettings
from edge_sdk.transport import MqttSettings

from .algorithms import hyperparameters
from .broker import EmbeddedBroker
from .config import RunConfig
from .events import Event
from .run_folder import RunFolder
from .server import Coordinator
from .settings import RunSettings, SimulationSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker process needs to host its share of the virtual devices."""

    indices: tuple[int, ...]
    connections: dict[str, MqttSettings]  # per device id
    run: RunSettings
    training: TrainSettings
    broker: BrokerSettings
    simulation: SimulationSettings
    declared_task: dict | None
    attacks: dict[int, str | None]
    lite_heads: dict[int, str]  # weak devices: index -> head kind
    out: str  # the run folder (RunFolder)
    log_level: int

    @classmethod
    def for_devices(cls, config: RunConfig, indices: tuple[int, ...], url: str) -> WorkerSpec:
        """The spec of a worker hosting devices `indices` of `config`'s run, reaching the broker at `url`."""
        first_lite = config.run.clients - config.lite_devices
        return cls(indices, {client_id_for(i): device_settings(config, url, client_id_for(i)) for i in indices},
                   config.run, config.training, config.broker, config.simulation, config.declared_task,
                   {i: config.attack_of(i) for i in indices},
                   {i: config.simulation.head for i in indices if i >= first_lite},
                   config.run.out,
                   logging.getLogger().getEffectiveLevel())


def client_id_for(index: int) -> str:
    return f"dev{index:03d}"


def _worker_main(spec: WorkerSpec) -> None:
    """Entry point of a worker process: run its devices until the coordinator finishes."""
    import torch

    from edge_sdk.client import EdgeClient

    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(processName)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    lock = threading.Lock()
    threads = []
    for index in spec.indices:
        data = spec.run.client_data(index, spec.training.seed, spec.declared_task)
        client_id = client_id_for(index)
        session = {"broker": spec.connections[client_id], "federation": spec.broker.federation,
                   "state_dir": RunFolder(spec.out).device_state(client_id), "chunk_size": spec.broker.upload_chunk_size}
        if index in spec.lite_heads:
            from edge_sdk.lite import LiteClient

            client = LiteClient(client_id, data, head=spec.lite_heads[index],
                                model_path=RunFolder(spec.out).device_model(client_id), **session)
        else:
            client = EdgeClient(client_id, data, device=spec.simulation.device, amp=spec.simulation.amp,
                                compute_lock=lock, attack=spec.attacks[index], **session)
        thread = threading.Thread(target=client.run, name=client_id, daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()


def device_settings(config: RunConfig, url: str, client_id: str) -> MqttSettings:
    """A simulated device's connection: the shared username if one is given, else its own
    account from `credentials`, if any."""
    return config.mqtt_settings(url, account=client_id)


def split_among_workers(clients: int, workers: int) -> list[tuple[int, ...]]:
    workers = max(1, min(workers, clients))
    return [tuple(range(w, clients, workers)) for w in range(workers)]


def watch_workers(workers: dict[multiprocessing.Process, list[str]], done: threading.Event) -> threading.Thread:
    """Log an error naming the devices (`workers` maps each process to its device ids) of any worker
    process that dies before `done` is set.

    Its devices' Last Wills make the coordinator close the round without them; without this line
    the run would only say that nobody replied. A worker killed by SIGKILL was most often the
    kernel's OOM killer (see `dmesg`).
    """

    def watch() -> None:
        alive = list(workers)
        while alive and not done.is_set():
            ended = multiprocessing.connection.wait([p.sentinel for p in alive])
            for process in [p for p in alive if p.sentinel in ended]:
                alive.remove(process)
                process.join()
                code = process.exitcode  # None when the run's own join reaped it first (after `done`)
                if not done.is_set() and code not in (0, None):
                    cause = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                    oom = " (SIGKILL: most often the OOM killer; see dmesg)" if code == -signal.SIGKILL else ""
                    log.error("%s died with %s%s; its devices are gone: %s", process.name, cause, oom,
                              ", ".join(workers[process]))

    thread = threading.Thread(target=watch, name="worker-watch", daemon=True)
    thread.start()
    return thread


def run_simulation(config: RunConfig, *, on_round: Callable[[dict[str, Any]], None] | None = None,
                   on_event: Callable[[Event], None] | None = None) -> dict[str, Any]:
    """Run `config` end to end and return the report (also written to `config.run.out`); `on_event`
    receives every event of the coordinator (coordinator/events.py)."""
    from edge_sdk.models import resolve_factory

    hyperparameters(config.run.algorithm, config.hyper)  # a bad key fails before anything starts
    resolve_factory(config.model_name, config.task())  # so does a bad model or data file
    if config.broker.federation == "default":
        config = config.replace(federation=f"sim-{uuid.uuid4().hex[:8]}")
    broker = EmbeddedBroker().start() if config.broker.broker is None else None
    url = broker.url if broker else config.broker.broker
    if broker is not None:
        config = config.replace(mqtt_protocol="3.1.1")  # amqtt speaks MQTT 3.1.1 only
    context = multiprocessing.get_context("spawn")
    workers: dict[multiprocessing.Process, list[str]] = {}  # process -> its device ids
    done = threading.Event()
    try:
        for indices in split_among_workers(config.run.clients, config.worker_count):
            spec = WorkerSpec.for_devices(config, indices, url)
            process = context.Process(target=_worker_main, args=(spec,), name=f"worker{len(workers)}", daemon=True)
            process.start()
            workers[process] = list(spec.connections)
        watch_workers(workers, done)
        transport = config.coordinator_transport(url)
        transport.connect()
        try:
            coordinator = Coordinator(config, config.coordinator_channel(transport), on_round=on_round)
            if on_event is not None:
                coordinator.subscribe(on_event)
            report = coordinator.run()
        finally:
            transport.close()
        done.set()  # the workers now end on their own: not news for the watch
        for process in workers:
            process.join(timeout=30)
        return report
    finally:
        done.set()
        for process in workers:
            if process.is_alive():
                process.terminate()
                process.join(timeout=10)
        if broker is not None:
            broker.stop()
