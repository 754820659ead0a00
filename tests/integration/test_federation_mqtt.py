"""A coordinator and three devices complete two rounds over a real broker (Mosquitto and amqtt)."""

from __future__ import annotations

import json
import threading

import pytest

from coordinator.config.run_config import RunConfig
from coordinator.run.folder import RunFolder
from coordinator.server import Coordinator
from edge_sdk.channel import Channel
from edge_sdk.client import EdgeClient
from edge_sdk.data import load_client_data
from edge_sdk.protocol import Topics
from edge_sdk.transport import MqttSettings, MqttTransport

pytestmark = pytest.mark.integration


def run_federation(url: str, protocol: str, out, *, clients: int = 3, rounds: int = 2, **overrides):
    """Coordinator in this thread, devices in threads with their own MQTT connections."""
    config = RunConfig.of(algorithm="fedavg", dataset="digits", clients=clients, rounds=rounds, out=str(out),
                          federation="itest", round_timeout=60, registration_timeout=60, local_epochs=1, **overrides)
    settings = MqttSettings(url=url, protocol=protocol)
    stop = threading.Event()
    devices = []
    for index in range(clients):
        data = load_client_data("digits", num_clients=clients, index=index, seed=0)
        client = EdgeClient(f"dev{index}", data, broker=settings, federation="itest", state_dir=out / f"dev{index}")
        thread = threading.Thread(target=client.run, args=(stop,), daemon=True)
        thread.start()
        devices.append((client, thread))
    transport = MqttTransport("itest.coordinator", settings)
    transport.connect()
    try:
        report = Coordinator(config, Channel(transport, Topics("itest"))).run()
    finally:
        transport.close()
        for _, thread in devices:
            thread.join(timeout=30)
        stop.set()
    return report, devices


def test_three_devices_complete_two_rounds(any_broker, tmp_path):
    url, protocol = any_broker

    report, devices = run_federation(url, protocol, tmp_path)

    assert report["rounds_completed"] == 2
    assert [r["participants"] for r in report["rounds"]] == [3, 3]
    assert set(report["final"]["per_client"]) == {"dev0", "dev1", "dev2"}
    assert report["final"]["personalized_accuracy"]["mean"] > 0.5
    assert report["communication"]["bytes_up"] > 0 and report["communication"]["bytes_down"] > 0
    lines = [json.loads(line) for line in RunFolder(tmp_path).metrics.read_text().splitlines()]
    assert [line["round"] for line in lines if line["event"] == "round"] == [1, 2]
    for client, thread in devices:
        assert not thread.is_alive(), "devices leave when the coordinator finishes"
        assert client.rounds_trained == 2
        assert (tmp_path / client.client_id / f"personal-{client.client_id}.msgpack").exists()


def test_model_is_broadcast_once_per_round_not_per_device(mosquitto, tmp_path):
    report, _ = run_federation(mosquitto.url, "auto", tmp_path, clients=3, rounds=1)

    down = report["communication"]["by_kind"]["down"]
    up = report["communication"]["by_kind"]["up"]
    # one TRAIN broadcast carries the model once; three devices each upload one model
    assert 2.5 < up["train_res"] / down["train"] < 3.5
