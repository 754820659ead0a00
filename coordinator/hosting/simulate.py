"""A whole federation on one machine, honestly over MQTT; or its devices spread over hosts.

The broker (embedded amqtt unless `--broker` names one), the coordinator in this process, and
the devices in worker processes, each hosting several virtual devices with their own MQTT
connections. Devices in one worker take turns to compute (one lock per worker) so that the
workers, not the threads, use the cores. A `WorkerPool` is the same worker processes for any
share of the devices: `edgepfl simulate` starts one for its share (`local`, all devices unless
told otherwise) and `edgepfl workers` (coordinator/hosting/workers.py) one for a share on another host.
With `shards` K, `edgepfl simulate` also hosts the shard aggregators (`local_aggregators`, all
unless told otherwise; the others run `edgepfl aggregator` on other hosts): an `AggregatorPool`,
one process per shard, each a `ShardAggregator` under its own MQTT identity (`aggregator-<k>`).

A worker also plays its devices' availability and speed (`availability`, `speed_spread`;
coordinator/hosting/availability.py): once they joined, it takes each offline and back on its seeded
schedule or trace, and each trainer waits its speed factor's extra time after computing.

Runs repeat: what the coordinator hands out in order of registration (FediOS's projection
blocks, DC-PFL's body models) it hands out in device index order before registration opens
(the Coordinator's `roster`), so the order the HELLOs arrive in, from one host or several,
does not matter; each device draws its randomness from generators of its own seed, never from
torch's global one.

A worker that cannot host its devices (their data cannot be found, the broker refuses them)
sends its error, one line, to the parent through a pipe of its own and exits with code 1; once
every worker is gone the run stops with their errors (`WorkersFailed`) instead of waiting for
registrations that cannot come. A worker some of whose devices failed sends their errors the
same way and exits with 0 (`edgepfl workers` then fails; a simulation goes on without them).
An aggregator process that dies is logged the same way, naming its shard; the coordinator
loses that shard's updates from then on and says so in each round's `lost_shards`.
Ctrl-C is the parent's alone: workers and aggregators start with SIGINT blocked, then ignore
it, and are stopped by the parent, with the embedded broker, before the KeyboardInterrupt goes
on (coordinator/hosting/lifecycle.py runs the broker, the processes and the coordinator in order). A
child ended by a signal that stops the whole process group (SIGTERM, SIGHUP) is not reported as
a death once the parent is stopping too.
"""

from __future__ import annotations

import gc
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, cast

from edge_sdk.config import ConfigError
from edge_sdk.lifecycle import run_until_done
from edge_sdk.protocol import aggregator_id
from edge_sdk.settings import BrokerSettings, TrainSettings
from edge_sdk.transport import MqttSettings, MqttTransport, TransportError

from ..algorithms import hyperparameters
from ..config.run_config import RunConfig
from ..config.sections import RunSettings, SimulationSettings
from ..events import Event
from ..run.folder import RunFolder
from ..server import Coordinator
from .availability import AvailabilityDriver, SlowedLock, offline_spells, parse_availability, speed_factor
from .device_ranges import client_id_for, describe_indices
from .lifecycle import LocalFederation, ignore_ctrl_c
from .worker_watch import (SHARD_LOST, WatchedChannel, WorkerWatch, pending_error, stop_processes,
                           watch_workers)

if TYPE_CHECKING:
    from edge_sdk.channel import Channel
    from edge_sdk.session import DeviceSession

log = logging.getLogger(__name__)

WORKER_FAILED = 1
"""A worker's exit code when it could not host any of its devices, an aggregator's when it failed
(the error is in its pipe)."""


JOIN_POLL = 0.02
"""Seconds between two looks at whether a starting device has joined the run."""

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
    secure_aggregation: bool = False
    """Devices take their secure-aggregation keys from the run folder (`RunFolder.device_identity`)."""

    @classmethod
    def for_devices(cls, config: RunConfig, indices: tuple[int, ...], url: str) -> WorkerSpec:
        """The spec of a worker hosting devices `indices` of `config`'s run, reaching the broker at `url`."""
        first_lite = config.run.clients - config.lite_devices
        return cls(indices, {client_id_for(i): device_settings(config, url, client_id_for(i)) for i in indices},
                   config.run, config.training, config.broker, config.simulation, config.declared_task,
                   {i: config.attack_of(i) for i in indices},
                   {i: config.simulation.head for i in indices if i >= first_lite},
                   config.run.out,
                   logging.getLogger().getEffectiveLevel(), config.secagg.secure_aggregation)


def _worker_main(spec: WorkerSpec, errors: Connection,
                 hosting: Connection) -> None:
    """Entry point of a worker process: run its devices until the coordinator finishes. Once its
    devices have joined it sends its `Hosting` (JSON) through `hosting`. If any device failed it
    sends why (one line) through `errors`; if none of them could run it exits with `WORKER_FAILED`."""
    ignore_ctrl_c()  # Ctrl-C is the parent's: it stops this process
    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(processName)s %(name)s: %(message)s")
    try:
        from edge_sdk.training import one_thread

        with one_thread():  # the workers use the cores; one thread also makes a device's results repeat anywhere
            failures = _host_devices(spec, hosting)
    except Exception as exc:  # noqa: BLE001 - whatever it is, the parent reports it in one line
        failures = [_one_line(exc)] * len(spec.indices)
        log.debug("worker failed", exc_info=True)
    if failures:
        errors.send_bytes("; ".join(sorted(set(failures))).encode())
    skip_final_collection()
    if len(failures) >= len(spec.indices):
        sys.exit(WORKER_FAILED)


def skip_final_collection() -> None:
    """Leave what this child process allocated out of the garbage collection that ends the
    interpreter (`gc.freeze`): its devices are done and their connections closed, and collecting
    a heap of torch and NumPy objects on the way out took a worker seconds (the run waits for its
    workers to end). Memory is returned by the exit all the same; `atexit` handlers still run."""
    gc.freeze()


def _one_line(exc: BaseException) -> str:
    """An error as one line: the message of the errors that explain themselves, else its type too."""
    text = str(exc) if isinstance(exc, (ConfigError, TransportError, OSError)) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())


def resident_bytes() -> int:
    """This process's resident set size (RSS) now, in bytes (Linux: /proc/self/statm; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@dataclass(frozen=True)
class Hosting:
    """What one worker process measured once its devices joined: how many joined, and its RSS
    before the first device was started (torch and the SDK imported) and after the last joined."""

    devices: int
    rss_before: int
    rss_after: int

    def to_bytes(self) -> bytes:
        return json.dumps({"devices": self.devices, "rss_before": self.rss_before,
                           "rss_after": self.rss_after}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Hosting:
        """A worker's report, checked field by field (JSON of three counts; never unpickled)."""
        plain = json.loads(data)
        values = [plain.get(key) if isinstance(plain, dict) else None for key in ("devices", "rss_before", "rss_after")]
        counts = [value for value in values if isinstance(value, int) and value >= 0]
        if len(counts) != len(values):
            raise ValueError(f"malformed hosting report {data[:80]!r}")
        return cls(*counts)


def _host_devices(spec: WorkerSpec, hosting: Connection) -> list[str]:
    """Run the worker's devices, one thread each, until they end; returns the errors of those that
    failed. Each device starts once the one before it has joined the run (or ended)."""
    from edge_sdk.client import EdgeClient  # noqa: F401 - imported before the RSS is taken: shared by every device

    lock = threading.Lock()
    threads: list[threading.Thread] = []
    clients: dict[int, DeviceSession] = {}
    failures: list[str] = []
    before = resident_bytes()
    for index in spec.indices:
        try:
            thread, client = _start_device(spec, index, lock, failures)
        except Exception as exc:  # noqa: BLE001 - e.g. its data cannot be read; the other devices go on
            failures.append(_one_line(exc))
            log.error("%s could not start: %s", client_id_for(index), failures[-1])
            log.debug("%s's failure", client_id_for(index), exc_info=True)
            continue
        threads.append(thread)
        clients[index] = client
    hosting.send_bytes(Hosting(sum(c.joined for c in clients.values()), before, resident_bytes()).to_bytes())
    ended = threading.Event()
    availability = parse_availability(spec.simulation.availability, spec.run.clients)
    if availability is not None:
        seed = spec.training.seed
        AvailabilityDriver([(client, transport, offline_spells(availability, seed, index))
                            for index, client in clients.items()
                            if isinstance(transport := client.channel.transport, MqttTransport)], ended).start()
    for thread in threads:
        thread.join()
    ended.set()
    return failures


def _start_device(spec: WorkerSpec, index: int, lock: threading.Lock,
                  failures: list[str]) -> tuple[threading.Thread, DeviceSession]:
    """Start device `index` of the worker in a thread of its own; return (the thread, the
    device) once it has joined the run (or its session ended)."""
    from edge_sdk.client import EdgeClient

    data = spec.run.client_data(index, spec.training.seed, spec.declared_task)
    client_id = client_id_for(index)
    session: dict[str, Any] = {"broker": spec.connections[client_id], "federation": spec.broker.federation,
               "state_dir": RunFolder(spec.out).device_state(client_id), "chunk_size": spec.broker.upload_chunk_size}
    client: DeviceSession
    keys = None
    if spec.secure_aggregation:
        from edge_sdk.secagg.device import SecAggKeys

        folder = RunFolder(spec.out)
        keys = SecAggKeys.load(folder.device_identity(client_id), folder.secagg_roster)
    if index in spec.lite_heads:
        from edge_sdk.lite import LiteClient

        client = LiteClient(client_id, data, head=spec.lite_heads[index], secagg_keys=keys,
                            model_path=RunFolder(spec.out).device_model(client_id), **session)
    else:
        factor = speed_factor(spec.simulation.speed_spread, spec.training.seed, index)
        client = EdgeClient(client_id, data, device=spec.simulation.device, amp=spec.simulation.amp,
                            compute_lock=SlowedLock(lock, factor) if factor > 1 else lock, attack=spec.attacks[index],
                            secagg_keys=keys, **session)
    thread = threading.Thread(target=_run_device, args=(client, failures), name=client_id, daemon=True)
    thread.start()
    while thread.is_alive() and not client.joined:
        thread.join(JOIN_POLL)
    return thread, client


def _run_device(client: DeviceSession, failures: list[str]) -> None:
    """Run one device's session; its failure is logged in one line and added to `failures`."""
    try:
        run_until_done(client)
    except Exception as exc:  # noqa: BLE001 - the other devices of the worker go on
        failures.append(_one_line(exc))
        log.error("%s stopped: %s", client.client_id, failures[-1])
        log.debug("%s's failure", client.client_id, exc_info=True)


def device_settings(config: RunConfig, url: str, client_id: str) -> MqttSettings:
    """A simulated device's connection: the shared username if one is given, else its own
    account from `credentials`, if any."""
    return config.mqtt_settings(url, account=client_id)


def split_among_workers(indices: Sequence[int], workers: int) -> list[tuple[int, ...]]:
    """Devices `indices` dealt round robin to at most `workers` processes (none without devices)."""
    indices = tuple(indices)
    workers = max(1, min(workers, len(indices)))
    return [indices[w::workers] for w in range(workers)] if indices else []


class WorkerPool:
    """Worker processes (`config.worker_count` at most) hosting devices `indices` of `config`'s
    run, reaching the broker at `url`; started on creation. `stop` ends those still alive."""

    def __init__(self, config: RunConfig, indices: Sequence[int], url: str):
        context = multiprocessing.get_context("spawn")
        self.devices: dict[BaseProcess, list[str]] = {}  # process -> its device ids
        self.errors: dict[BaseProcess, Connection] = {}
        self.hosting: dict[BaseProcess, Connection] = {}
        try:
            for share in split_among_workers(indices, config.worker_count):
                spec = WorkerSpec.for_devices(config, share, url)
                errors, errors_end = context.Pipe(duplex=False)
                hosting, hosting_end = context.Pipe(duplex=False)
                process = context.Process(target=_worker_main, args=(spec, errors_end, hosting_end),
                                          name=f"worker{len(self.devices)}", daemon=True)
                process.start()
                errors_end.close()  # the worker holds the write ends now
                hosting_end.close()
                self.devices[process] = list(spec.connections)
                self.errors[process], self.hosting[process] = errors, hosting
        except BaseException:
            self.stop()
            raise

    def watch(self, done: threading.Event) -> WorkerWatch:
        """Start a `WorkerWatch` over the pool's processes (see there)."""
        return watch_workers(self.devices, done, self.errors)

    def hosted(self, timeout: float) -> list[Hosting] | None:
        """Each worker's `Hosting` once every worker has sent it or ended (those that ended
        without one are left out); None if that takes longer than `timeout` seconds."""
        deadline = time.monotonic() + timeout
        waiting, reports = list(self.hosting.values()), []
        while waiting:
            # wait returns those of the objects it was given that are ready: here, pipes
            ready = cast("list[Connection]",
                         multiprocessing.connection.wait(waiting, timeout=max(0.0, deadline - time.monotonic())))
            if not ready:
                return None
            for pipe in ready:
                waiting.remove(pipe)
                try:
                    reports.append(Hosting.from_bytes(pipe.recv_bytes()))
                except (EOFError, OSError):  # the worker ended before its devices joined
                    pass
        return reports

    def join(self, timeout: float | None = None) -> None:
        for process in self.devices:
            process.join(timeout)

    def partial_failures(self) -> dict[str, str]:
        """Once the workers ended: the errors of devices that failed in workers that went on
        (a worker that died is the watch's to report), by worker name."""
        failures = {}
        for process in self.devices:
            error = pending_error(self.errors[process]) if process.exitcode == 0 else None
            if error is not None:
                failures[process.name] = error
        return failures

    def stop(self) -> None:
        """Terminate the workers still alive and close the pipes."""
        stop_processes(list(self.devices), [*self.errors.values(), *self.hosting.values()])


@dataclass(frozen=True)
class AggregatorSpec:
    """What one aggregator process needs: its shard of `shards`, its connection (the account
    `aggregator-<k>`) and federation, and the credentials file whose devices' signing keys it
    checks uploads with, as the coordinator checks them unsharded."""

    shard: int
    shards: int
    connection: MqttSettings
    federation: str
    credentials: str | None
    log_level: int


def _aggregator_main(spec: AggregatorSpec, errors: Connection) -> None:
    """Entry point of an aggregator process: sum its shard's updates until the coordinator
    finishes. If it fails it sends why (one line) through `errors` and exits with `WORKER_FAILED`."""
    ignore_ctrl_c()  # Ctrl-C is the parent's: it stops this process
    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(processName)s %(name)s: %(message)s")
    try:
        from edge_sdk.signing import fleet_verifier

        from ..shards.aggregator import ShardAggregator

        verifier = fleet_verifier(spec.credentials) if spec.credentials else None
        run_until_done(ShardAggregator(spec.shard, spec.shards, broker=spec.connection, federation=spec.federation,
                                       verifier=verifier))
    except Exception as exc:  # noqa: BLE001 - whatever it is, the parent reports it in one line
        log.debug("aggregator failed", exc_info=True)
        errors.send_bytes(_one_line(exc).encode())
        sys.exit(WORKER_FAILED)
    skip_final_collection()


def _aggregator_connection(config: RunConfig, url: str, shard: int) -> MqttSettings:
    """How shard `shard`'s aggregator connects: its own account, `aggregator-<k>`, as `edgepfl
    aggregator` connects; a missing account is refused with where it comes from."""
    try:
        return config.mqtt_settings(url, account=aggregator_id(shard))
    except ConfigError as exc:
        raise ConfigError(f"{exc} (the shard aggregators connect with their own accounts: `edgepfl broker-config "
                          f"--shards {config.round.shards}` enrolls them)") from None


class AggregatorPool:
    """The aggregators of shards `shards` of `config`'s run, one process each, reaching the broker
    at `url`; started on creation (every connection is checked first: an account missing from
    `credentials` starts none). `stop` ends those still alive."""

    def __init__(self, config: RunConfig, shards: Sequence[int], url: str):
        context = multiprocessing.get_context("spawn")
        level = logging.getLogger().getEffectiveLevel()
        specs = [AggregatorSpec(k, config.round.shards, _aggregator_connection(config, url, k),
                                config.broker.federation, config.broker.credentials, level) for k in shards]
        self.shards: dict[BaseProcess, list[str]] = {}  # process -> its shard, in words
        self.errors: dict[BaseProcess, Connection] = {}
        try:
            for spec in specs:
                errors, errors_end = context.Pipe(duplex=False)
                process = context.Process(target=_aggregator_main, args=(spec, errors_end),
                                          name=aggregator_id(spec.shard), daemon=True)
                process.start()
                errors_end.close()  # the aggregator holds the write end now
                self.shards[process] = [f"shard {spec.shard} of {spec.shards}"]
                self.errors[process] = errors
        except BaseException:
            self.stop()
            raise

    def watch(self, done: threading.Event) -> WorkerWatch:
        """Start a `WorkerWatch` over the aggregators (see there): one that dies is logged with its shard."""
        return watch_workers(self.shards, done, self.errors, SHARD_LOST)

    def join(self, timeout: float | None = None) -> None:
        for process in self.shards:
            process.join(timeout)

    def stop(self) -> None:
        """Terminate the aggregators still alive and close the pipes."""
        stop_processes(list(self.shards), list(self.errors.values()))


def all_devices(config: RunConfig) -> tuple[int, ...]:
    """The indices of every device of the run."""
    return tuple(range(config.run.clients))


def run_simulation(config: RunConfig, *, local: Sequence[int] | None = None,
                   on_round: Callable[[dict[str, Any]], None] | None = None,
                   on_event: Callable[[Event], None] | None = None) -> dict[str, Any]:
    """Run `config` end to end and return the report (also written to `config.run.out`); `on_event`
    receives every event of the coordinator (coordinator/events.py).

    `local` are the devices this process hosts (default: all); the others are hosted elsewhere
    (`edgepfl workers`) and reach the coordinator through the broker that `config` names under
    the federation it names. While every device is local, the run stops once every worker is
    gone (`WorkersFailed`); with devices elsewhere it goes on with them. So with the shard
    aggregators: those of `config.local_shards` run here, the others elsewhere (`edgepfl
    aggregator`). Worker and aggregator processes are stopped when the run ends or fails."""
    from edge_sdk.models import resolve_factory

    local = all_devices(config) if local is None else tuple(local)
    remote = sorted(set(all_devices(config)) - set(local))
    remote_shards = sorted(set(range(config.round.shards)) - set(config.local_shards))
    connected = config.broker.broker is not None and config.broker.federation != "default"
    if remote and not connected:
        raise ConfigError(f"--local-devices leaves devices {describe_indices(remote)} to other hosts: give --broker "
                          "(a broker they reach) and --federation (the name they join with `edgepfl workers`)")
    if remote_shards and not connected:
        raise ConfigError(f"--local-aggregators leaves the aggregators of shards {describe_indices(remote_shards)} to "
                          "other hosts: give --broker (a broker they reach) and --federation (the name they join "
                          f"with `edgepfl aggregator --shard k/{config.round.shards}`)")
    hyperparameters(config.run.algorithm, config.hyper)  # a bad key fails before anything starts
    resolve_factory(config.model_name, config.task())  # so does a bad model or data file
    if config.run.init_from is not None:  # and a warm start's missing file
        from ..run.warm_start import source_file

        source_file(config.run.init_from)
    if config.secagg.secure_aggregation:  # the simulated fleet's enrollment: every device's identity key
        from edge_sdk.secagg.enroll import enroll

        folder = RunFolder(config.run.out)
        enroll([client_id_for(i) for i in range(config.run.clients)], folder.device_identity, folder.secagg_roster)
    with LocalFederation(config.replace(connect_timeout=0), "sim") as hosting:  # the broker is up: fail fast
        config, url = hosting.config, hosting.url
        aggregators = hosting.host(lambda: AggregatorPool(config, config.local_shards, url))
        aggregators.watch(hosting.done)
        watch = hosting.host(lambda: WorkerPool(config, local, url)).watch(hosting.done)

        def coordinator(channel: Channel) -> Coordinator:
            # a WatchedChannel is the channel it wraps (all but `receive` by delegation, unseen by the type checker)
            watched = channel if remote else cast("Channel", WatchedChannel(channel, watch))
            built = Coordinator(config, watched, on_round=on_round,
                                expected_devices=[client_id_for(i) for i in all_devices(config)],
                                partition=config.run.partition)
            if on_event is not None:
                built.subscribe(on_event)
            return built

        return hosting.run_coordinator(coordinator)
