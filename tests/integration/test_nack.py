"""A refused reply over a real deployment: Mosquitto set up by `edgepfl broker-config` (accounts,
per-device topic ACLs) and every upload sealed with its device's key, as the coordinator
requires when the credentials enrol keys.

A trainer that names no request in its replies (no `in_reply_to`) is refused: the round counts
its reply as its answer (`refused`) and ends without waiting for it, and the device learns why
from a NACK on its own downstream topic, which the broker's ACL lets the coordinator write and
that device (only) read.
"""

from __future__ import annotations

import logging
import threading

import pytest

from harness.brokers import ConfiguredMosquitto, require_mosquitto
from coordinator.brokers.embedded import free_port
from coordinator.brokers.mosquitto import generate
from coordinator.config.run_config import RunConfig
from coordinator.server import Coordinator
from edge_sdk.channel import Channel
from edge_sdk.client import EdgeClient
from edge_sdk.data import load_client_data
from edge_sdk.protocol import Envelope, Kind, Topics
from edge_sdk.signing import fleet_verifier
from edge_sdk.transport import MqttSettings, MqttTransport

pytestmark = pytest.mark.integration

FED = "nackfed"
DEVICES = ["dev000", "dev001", "dev002"]
WAIT = 60.0


class OldDocClient(EdgeClient):
    """A trainer whose replies name no request (`in_reply_to` missing)."""

    def send(self, kind: Kind, round_: int = 0, *, request: Envelope | None = None, **fields) -> None:
        super().send(kind, round_, **fields)


@pytest.fixture
def deployment(tmp_path):
    require_mosquitto()
    port = free_port()
    setup = generate(tmp_path / "broker", FED, DEVICES, port)
    with ConfiguredMosquitto(setup.config, port):
        yield setup


def _settings(setup, account: str) -> MqttSettings:
    entry = setup.accounts[account]
    key = bytes.fromhex(entry.signing_key) if entry.signing_key else None
    return MqttSettings(url=setup.url, username=entry.username, password=entry.password, signing_key=key)


def test_a_refused_reply_ends_its_devices_wait_and_the_device_is_told_why(deployment, tmp_path, caplog, monkeypatch):
    # Prepare: dev002 replies without `in_reply_to`; a round that waited for it would take 60 s
    monkeypatch.setattr("coordinator.run.report_files.plot_curves", lambda path, report: None)  # not under test here
    config = RunConfig.of(algorithm="fedavg", dataset="digits", clients=3, rounds=1, local_epochs=1, seed=0,
                          federation=FED, out=str(tmp_path / "run"), min_clients=2, quorum_grace=WAIT,
                          round_timeout=WAIT, registration_timeout=WAIT, device="cpu")
    stop, lock, threads = threading.Event(), threading.Lock(), []
    for index, client_id in enumerate(DEVICES):
        cls = OldDocClient if client_id == "dev002" else EdgeClient
        client = cls(client_id, load_client_data("digits", num_clients=3, index=index, seed=0),
                     broker=_settings(deployment, client_id), federation=FED, state_dir=tmp_path / client_id,
                     device="cpu", compute_lock=lock)
        threads.append(threading.Thread(target=client.run, args=(stop,), daemon=True))
    transport = MqttTransport(f"{FED}.coordinator", _settings(deployment, "coordinator"))
    transport.connect()
    verifier = fleet_verifier(deployment.credentials)
    assert verifier is not None and verifier.devices == set(DEVICES)

    # Execute
    for thread in threads:
        thread.start()
    try:
        with caplog.at_level(logging.WARNING, logger="edge_sdk.session"):
            report = Coordinator(config, Channel(transport, Topics(FED), verifier=verifier)).run()
            for thread in threads:
                thread.join(WAIT)
    finally:
        stop.set()
        transport.close()

    # Assert: the round did not wait for dev002; its reply counts as refused
    (record,) = report["rounds"]
    assert (record["outcome"], record["participants"], record["refused"], record["late"]) == ("complete", 2, 1, 0)
    assert record["seconds"] < WAIT
    assert report["rejections"] == {"stale": 2}
    assert report["communication"]["by_kind"]["down"]["nack"] > 0
    # ... and dev002 (no other device) logged the coordinator's NACK of its update
    told = [(r.getMessage().split(":")[0], r.getMessage()) for r in caplog.records
            if r.name == "edge_sdk.session" and "the coordinator refused" in r.getMessage()]
    assert [device for device, _ in told] == ["dev002", "dev002"]
    assert told[0][1].startswith("dev002: the coordinator refused train_res ") and ": stale" in told[0][1]
    assert "eval_res" in told[1][1]
