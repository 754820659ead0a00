"""The compatibility matrix's runner: one cell (an algorithm with a feature of
coordinator/compatibility.py) played as a whole run over the loopback broker, and its outcome.

A cell either completes (every round complete, the final accuracy above chance, the released
representation and the weak devices' models loadable by onnxruntime) or is refused at start
with the one-line ConfigError the docs table names. Anything else fails the cell, with what was
seen: a run that outlives its limit (a hang), an aborted round, a device's refusal upward, a
traceback in the coordinator or a device.
"""

from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator import compatibility
from coordinator.compatibility import Feature
from edge_sdk.config import ConfigError
from loopback_runs import DropsItsFirstUpdate, LoopbackFederation

RUN_LIMIT = 120.0  # seconds a cell's run may take before it counts as a hang
CHANCE = 0.1  # digits has ten classes


@dataclass
class Outcome:
    """What a cell did: `refused` with the ConfigError's message, or ran (`failure` None when it
    completed as it should), in `seconds`."""

    refused: str | None = None
    failure: str | None = None
    seconds: float = 0.0


class MatrixFederation(LoopbackFederation):
    """A LoopbackFederation that keeps what its devices' threads raised, to fail the cell with it."""

    def __init__(self, tmp_path: Path, federation: str):
        super().__init__(tmp_path, federation)
        self.errors: list[str] = []
        self.clients: dict[str, Any] = {}  # trainers and lite clients

    def run_device(self, client) -> None:
        original = client.run

        def run(stop) -> None:
            try:
                original(stop)
            except BaseException:
                self.errors.append(f"{client.client_id}: {traceback.format_exc(limit=4)}")
                raise

        client.run = run
        self.clients[client.client_id] = client
        super().run_device(client)


def play(tmp_path: Path, algorithm: str, feature: Feature, sources: dict[str, Path]) -> Outcome:
    """Run the cell (`sources`: each algorithm's finished plain run folder, the warm start of
    `init_from == "run"` cells; a plain cell adds its own) and say what it did."""
    started = time.monotonic()
    outcome = _play(tmp_path, algorithm, feature, sources)
    outcome.seconds = time.monotonic() - started
    return outcome


def _play(tmp_path: Path, algorithm: str, feature: Feature, sources: dict[str, Path]) -> Outcome:
    fed = MatrixFederation(tmp_path, f"matrix-{algorithm}-{feature.name}".replace("+", "-"))
    try:
        settings = compatibility.cell_settings(algorithm, feature, fed.folder.path)
        settings.update(round_timeout=20.0, registration_timeout=20.0, quorum_grace=15.0)
        if feature.availability is not None:
            trace = tmp_path / "availability.csv"
            trace.write_text(feature.availability)
            settings["availability"] = str(trace)
        if feature.init_from is not None:
            settings["init_from"] = str(_source(tmp_path, algorithm, feature, sources))
        try:
            config = fed.config(**settings)
            if feature.restart == "coordinator":
                failure = _run(fed, fed.coordinator(config.replace(rounds=1)), feature, rounds=1)
                if failure is not None:
                    return Outcome(failure=f"before the restart: {failure}")
                fed.threads.clear()
            coordinator = fed.coordinator(config)
        except ConfigError as exc:
            return Outcome(refused=compatibility.without_folders(str(exc)))
        failure = _run(fed, coordinator, feature, rounds=config.training.rounds)
        if failure is None and feature.name == "plain":
            sources[algorithm] = fed.folder.path
        return Outcome(failure=failure)
    finally:
        fed.shutdown()


def _source(tmp_path: Path, algorithm: str, feature: Feature, sources: dict[str, Path]) -> Path:
    """The warm start `feature.init_from` names: the algorithm's finished plain run (played first
    when it has not been), or the model's arrays written for it."""
    if feature.init_from != "run":
        return compatibility.write_source(algorithm, feature, tmp_path)
    if algorithm not in sources:
        plain = play(tmp_path / "source", algorithm, compatibility.FEATURE_BY_NAME["plain"], sources)
        if plain.refused or plain.failure:
            raise AssertionError(f"the source run of {algorithm} did not complete: {plain}")
    return sources[algorithm]


def _run(fed: MatrixFederation, coordinator, feature: Feature, rounds: int) -> str | None:
    """Start the cell's devices, run `coordinator` to its end; None when it completed as a cell
    should, else what went wrong."""
    _start_fleet(fed, coordinator.config, feature)
    result: dict = {}
    errors: list[str] = []

    def run() -> None:
        try:
            result.update(coordinator.run())
        except BaseException:
            errors.append(f"coordinator: {traceback.format_exc(limit=6)}")

    runner = threading.Thread(target=run, name="coordinator", daemon=True)
    runner.start()
    ended = threading.Event()
    _play_availability(fed, coordinator.config, ended)
    runner.join(RUN_LIMIT)
    ended.set()
    coordinator.channel.transport.close()
    if runner.is_alive():
        fed.stop.set()
        return f"hang: the run had not ended after {RUN_LIMIT:.0f} s"
    if not fed.devices_exit():
        return "hang: a device did not leave after the run finished"
    if errors or fed.errors:
        return "traceback: " + "\n".join(errors + fed.errors)
    return _judge(result, coordinator, rounds)


def _start_fleet(fed: MatrixFederation, config, feature: Feature) -> None:
    """The cell's trainers (with secure-aggregation keys when secure), weak devices with the
    feature's head, and shard aggregators."""
    from edge_sdk.secagg import IdentityKey, Roster
    from edge_sdk.secagg.device import SecAggKeys

    clients, lite = config.run.clients, config.lite_devices
    keys: list = [None] * clients
    if config.secagg.secure_aggregation:
        identities = [IdentityKey.generate() for _ in range(clients)]
        roster = Roster({f"dev{i:03d}": key.public_hex() for i, key in enumerate(identities)})
        keys = [SecAggKeys(identity, roster) for identity in identities]
    for shard in range(config.round.shards):
        fed.start_aggregator(shard, config.round.shards)
    for i in range(clients - lite):
        transport = DropsItsFirstUpdate if feature.restart == "device" and i == 0 else None
        given_transport: dict[str, Any] = {"transport_type": transport} if transport else {}
        fed.start_device(i, clients, secagg_keys=keys[i], **given_transport)
    for i in range(clients - lite, clients):
        _start_lite(fed, i, clients, config.simulation.head, keys[i])


def _play_availability(fed: MatrixFederation, config, ended: threading.Event) -> None:
    """Play the run's `--availability` trace on its trainers (as `edgepfl simulate` does) until `ended`."""
    from coordinator.hosting.availability import AvailabilityDriver, offline_spells, parse_availability

    availability = parse_availability(config.simulation.availability, config.run.clients)
    if availability is None:
        return
    devices = [(client, client.channel.transport,
                offline_spells(availability, config.training.seed, int(client_id[3:])))
               for client_id, client in fed.clients.items() if client_id.startswith("dev")]
    AvailabilityDriver(devices, ended, poll=0.05).start()


def _start_lite(fed: MatrixFederation, index: int, clients: int, head: str, secagg_keys) -> None:
    """Weak device `index` of `clients` (a LiteClient with `head`) on its digits partition."""
    from edge_sdk import wire
    from edge_sdk.data import load_client_data
    from edge_sdk.lite import LiteClient
    from edge_sdk.protocol import Envelope, Kind

    client_id = f"dev{index:03d}"
    will = (fed.topics.up(client_id, Kind.OFFLINE), wire.encode(Envelope(Kind.OFFLINE, client_id)))
    client = LiteClient(client_id, load_client_data("digits", num_clients=clients, index=index, seed=0), head=head,
                        federation=fed.topics.federation, state_dir=fed.state_dir(client_id),
                        transport=fed.broker.transport(client_id, will=will), secagg_keys=secagg_keys)
    fed.run_device(client)


def _judge(report: dict, coordinator, rounds: int) -> str | None:
    """What is wrong with a finished run's report for a cell that should complete, or None."""
    outcomes = [r["outcome"] for r in report.get("rounds", [])]
    if report.get("rounds_completed") != rounds or outcomes != ["complete"] * rounds:
        why = [{"rejections": r.get("rejections"), "device_refusals": r.get("device_refusals")}
               for r in report.get("rounds", []) if r["outcome"] != "complete"]
        return (f"rounds: completed {report.get('rounds_completed')} of {rounds}, outcomes {outcomes}, "
                f"not complete because {why}; stopped: {report.get('stopped')}")
    accuracy = report["final"]["personalized_accuracy"]["mean"]
    if accuracy is None or not accuracy > CHANCE:
        return f"final accuracy {accuracy} not above chance ({CHANCE})"
    if coordinator.config.run.release or coordinator.algorithm.releases_representation:
        return _unloadable(coordinator)
    return None


def _unloadable(coordinator) -> str | None:
    """What of a release onnxruntime cannot load, or None: the representation and every weak
    device's personal model."""
    import onnxruntime as ort

    folder, config = coordinator.folder, coordinator.config
    lite = [f"dev{i:03d}" for i in range(config.run.clients - config.lite_devices, config.run.clients)]
    personal = [folder.device_state(device) / f"personalized-{device}.onnx" for device in lite]
    missing = [path.name for path in personal if not path.is_file()]
    if missing:
        return f"release: no weak device's model {', '.join(missing)}"
    paths = [folder.release, *personal]
    for path in paths:
        try:
            ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own types
            return f"release: onnxruntime cannot load {path.name}: {exc}"
    return None
