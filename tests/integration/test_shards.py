"""Sharded aggregation over a real Mosquitto: two shard aggregators give the single coordinator's
global state; an aggregator killed mid-round loses only its shard's updates of that round;
forged partials are refused and counted."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.config.run_config import RunConfig
from coordinator.run.folder import RunFolder
from coordinator.server import Coordinator
from coordinator.shards.aggregator import ShardAggregator
from coordinator.shards.sharding import shard_of
from edge_sdk import wire
from edge_sdk.channel import Channel
from edge_sdk.client import EdgeClient
from edge_sdk.data import load_client_data
from edge_sdk.protocol import Envelope, Kind, Topics
from edge_sdk.transport import MqttSettings, MqttTransport
from saved_runs import checkpoint_at
from test_doubles import CoordinatorThread

pytestmark = pytest.mark.integration

REPOSITORY = Path(__file__).resolve().parents[2]
WAIT = 120.0


def ids_in_shards(per_shard: int, shards: int = 2) -> list[str]:
    """Device ids, `per_shard` of them in each shard (by `shard_of`), shard 0's first."""
    found: dict[int, list[str]] = {k: [] for k in range(shards)}
    index = 0
    while any(len(ids) < per_shard for ids in found.values()):
        client_id = f"dev{index}"
        if len(found[shard_of(client_id, shards)]) < per_shard:
            found[shard_of(client_id, shards)].append(client_id)
        index += 1
    return [client_id for k in range(shards) for client_id in found[k]]


class GatedClient(EdgeClient):
    """A device that trains round `gate_round` only once `gate` is set (a straggler the test releases)."""

    def __init__(self, *args, gate_round: int, gate: threading.Event, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate_round, self.gate = gate_round, gate

    def _on_train(self, envelope: Envelope) -> None:
        if envelope.round == self.gate_round:
            self.gate.wait(WAIT)
        super()._on_train(envelope)


def start_devices(url: str, federation: str, ids: list[str], out: Path, stop: threading.Event,
                  gated: dict[str, tuple[int, threading.Event]] | None = None) -> list[threading.Thread]:
    lock, threads = threading.Lock(), []
    for index, client_id in enumerate(ids):
        data = load_client_data("digits", num_clients=len(ids), index=index, seed=0)
        common: dict[str, Any] = dict(broker=MqttSettings(url=url), federation=federation, state_dir=out / client_id,
                                      compute_lock=lock)
        client: EdgeClient
        if gated and client_id in gated:
            gate_round, gate = gated[client_id]
            client = GatedClient(client_id, data, gate_round=gate_round, gate=gate, **common)
        else:
            client = EdgeClient(client_id, data, **common)
        thread = threading.Thread(target=client.run, args=(stop,), daemon=True, name=client_id)
        thread.start()
        threads.append(thread)
    return threads


def run_config(out: Path, federation: str, **values) -> RunConfig:
    settings = dict(algorithm="fedavg", dataset="digits", clients=4, rounds=2, federation=federation,
                    round_timeout=60, registration_timeout=60, local_epochs=1, aggregation_dtype="float64")
    return RunConfig.of(out=str(out), **{**settings, **values})


def run_federation(url: str, out: Path, federation: str, ids: list[str], *, shards: int = 0, **values):
    """A run with the devices (and `shards` aggregators) as threads; returns the report and the final state."""
    config = run_config(out, federation, clients=len(ids), shards=shards, **values)
    stop = threading.Event()
    threads = start_devices(url, federation, ids, out, stop)
    aggregators = [ShardAggregator(k, shards, broker=url, federation=federation) for k in range(shards)]
    report = coordinate(url, config, aggregators, threads, stop)
    return report, checkpoint_at(RunFolder(out).checkpoint).state, aggregators


def coordinate(url: str, config: RunConfig, aggregators: list[ShardAggregator], threads: list[threading.Thread],
               stop: threading.Event) -> dict:
    """Start the `aggregators` as threads beside the devices' `threads`, run the coordinator of
    `config` to its report, then stop and join them all."""
    federation = config.broker.federation
    started = [threading.Thread(target=a.run, args=(stop,), daemon=True) for a in aggregators]
    for thread in started:
        thread.start()
    transport = MqttTransport(f"{federation}.coordinator", MqttSettings(url=url))
    transport.connect()
    try:
        return Coordinator(config, Channel(transport, Topics(federation))).run()
    finally:
        transport.close()
        stop.set()
        for thread in threads + started:
            thread.join(timeout=30)


@pytest.mark.parametrize("algorithm", ["fedavg", "fedper"])
def test_two_shards_give_the_single_coordinators_global_state(mosquitto, tmp_path, algorithm):
    # Prepare
    ids = ids_in_shards(2)

    # Execute
    single, single_state, _ = run_federation(mosquitto.url, tmp_path / "single", f"one-{algorithm}", ids,
                                             algorithm=algorithm)
    sharded, sharded_state, aggregators = run_federation(mosquitto.url, tmp_path / "sharded", f"two-{algorithm}", ids,
                                                         shards=2, algorithm=algorithm)

    # Assert
    assert [r["participants"] for r in sharded["rounds"]] == [4, 4]
    assert [r["lost_shards"] for r in sharded["rounds"]] == [[], []]
    assert [a.partials_sent for a in aggregators] == [2, 2]
    assert sharded["rejections"] == {} and sharded["final"]["devices_registered"] == 4
    assert set(single_state) == set(sharded_state)
    for group, arrays in single_state.items():
        assert set(arrays) == set(sharded_state[group])
        for key, value in arrays.items():
            np.testing.assert_allclose(sharded_state[group][key], value, rtol=0, atol=1e-6, err_msg=key)
    # float64 sums of float32 changes are exact here: the same bits
    assert all(np.array_equal(v, sharded_state[g][k]) for g, a in single_state.items() for k, v in a.items())


def aggregator_process(url: str, federation: str, shard: int, shards: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPOSITORY)}
    return subprocess.Popen([sys.executable, "-m", "coordinator.cli", "-v", "aggregator",
                             "--shard", f"{shard}/{shards}", "--broker", url, "--federation", federation], env=env,
                            stdout=log.open("ab"), stderr=subprocess.STDOUT)


def watch(url: str, name: str, *topics: str) -> MqttTransport:
    """A plain MQTT subscriber the test reads what the run publishes with."""
    transport = MqttTransport(name, MqttSettings(url=url))
    transport.connect()
    for topic in topics:
        transport.subscribe(topic)
    return transport


def next_envelope(transport: MqttTransport, what) -> Envelope:
    while True:
        try:
            message = transport.incoming.get(timeout=WAIT)
        except queue.Empty:
            raise AssertionError("the awaited message did not come") from None
        envelope = wire.decode(bytes(message.payload))
        if what(envelope):
            return envelope


def test_an_aggregator_killed_mid_round_loses_its_shard_of_that_round_only(mosquitto, tmp_path):
    # Prepare: shard 0 = (fast0, slow0), shard 1 = (fast1, slow1); the slow ones train round 2
    # only once released, so round 2 is open when shard 1's aggregator has folded fast1's update
    federation, ids = "killed", ids_in_shards(2)
    slow0, slow1 = ids[1], ids[3]
    gate = threading.Event()
    config = run_config(tmp_path, federation, rounds=3, shards=2, min_clients=1)
    topics = Topics(federation)
    observer = watch(mosquitto.url, f"{federation}.observer", topics.up("aggregator-1", Kind.NOTE),
                     topics.down("aggregator-1", Kind.WELCOME))
    stop = threading.Event()
    logs = tmp_path / "aggregators.log"
    processes = [aggregator_process(mosquitto.url, federation, k, 2, logs) for k in range(2)]
    threads = start_devices(mosquitto.url, federation, ids, tmp_path, stop,
                            gated={slow0: (2, gate), slow1: (2, gate)})
    transport = MqttTransport(f"{federation}.coordinator", MqttSettings(url=mosquitto.url))
    transport.connect()
    coordinator = CoordinatorThread(Coordinator(config, Channel(transport, topics)))
    coordinator.start()
    try:
        # Execute: kill shard 1's aggregator once it noted an update of round 2, start a new one,
        # and release the stragglers once the new one is welcomed
        next_envelope(observer, lambda e: e.kind is Kind.NOTE and e.round == 2)
        processes[1].send_signal(signal.SIGKILL)
        processes[1].wait(timeout=30)
        processes.append(aggregator_process(mosquitto.url, federation, 1, 2, logs))
        next_envelope(observer, lambda e: e.kind is Kind.WELCOME and "refused" not in e.config)
        gate.set()
        coordinator.join(timeout=300)
    finally:
        gate.set()
        stop.set()
        transport.close()
        observer.close()
        for process in processes:
            if process.poll() is None:
                process.terminate()
            process.wait(timeout=30)
        for thread in threads:
            thread.join(timeout=30)

    # Assert
    assert coordinator.error is None, coordinator.error
    report = coordinator.report
    assert report is not None
    rounds = report["rounds"]
    assert report["rounds_completed"] == 3
    assert rounds[1]["lost_shards"] == [1] and rounds[1]["lost_updates"] == 1
    assert rounds[1]["outcome"] != "aborted" and rounds[1]["participants"] == 2
    assert rounds[1]["missing"] == 2
    assert [r["lost_shards"] for r in (rounds[0], rounds[2])] == [[], []], "the new aggregator sums round 3"
    assert [r["participants"] for r in (rounds[0], rounds[2])] == [4, 4], rounds
    assert any(e.get("event") == "shard_lost" and e.get("shard") == 1 for e in report["event_log"])


class ForgingAggregator(ShardAggregator):
    """Shard 1's aggregator gone bad in round 1: its partial is corrupted (`forgery`), and it
    also publishes a partial in the name of a trainer device."""

    def __init__(self, *args, forgery: str, impostor: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.forgery, self.impostor = forgery, impostor

    def send(self, kind: Kind, round_: int = 0, **fields) -> None:
        if kind is Kind.PARTIAL and round_ == 1:
            arrays = fields["groups"]["shared"]
            key = sorted(arrays)[0]
            arrays[key] = (np.full_like(arrays[key], np.nan) if self.forgery == "nan"
                           else np.zeros(arrays[key].size + 1, arrays[key].dtype))
            assert self.run_id is not None  # a partial comes after the WELCOME
            forged = Envelope(Kind.PARTIAL, self.impostor, run_id=self.run_id, round=round_, **fields)
            self.channel.send(self.topics.up(self.impostor, Kind.PARTIAL), forged)
        super().send(kind, round_, **fields)


@pytest.mark.parametrize("forgery, reason", [("nan", "non_finite"), ("shape", "bad_shape")])
def test_forged_partials_are_refused_and_counted(mosquitto, tmp_path, forgery, reason):
    # Prepare
    federation, ids = f"forged-{forgery}", ids_in_shards(2)
    config = run_config(tmp_path, federation, shards=2, min_clients=1)
    stop = threading.Event()
    threads = start_devices(mosquitto.url, federation, ids, tmp_path, stop)
    aggregators = [ShardAggregator(0, 2, broker=mosquitto.url, federation=federation),
                   ForgingAggregator(1, 2, broker=mosquitto.url, federation=federation, forgery=forgery,
                                     impostor=ids[0])]

    # Execute
    report = coordinate(mosquitto.url, config, aggregators, threads, stop)

    # Assert: round 1 aggregates shard 0 alone; the forged partials are counted by reason
    first, second = report["rounds"]
    assert first["lost_shards"] == [1] and first["lost_updates"] == 2 and first["participants"] == 2
    assert first["rejections"] == {reason: 1, "unknown_device": 1}
    assert second["lost_shards"] == [] and second["participants"] == 4
    state = checkpoint_at(RunFolder(tmp_path).checkpoint).state
    assert all(np.isfinite(v).all() for group in state.values() for v in group.values())
