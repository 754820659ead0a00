"""`edgepfl broker-config` against a real Mosquitto: accounts, per-device topic ACLs, mutual TLS.

ACL checks use a marker: the forbidden message goes first, then a permitted marker on the same
connection. Mosquitto handles one connection's packets in order and routes each one before
the next, so once the marker has arrived a forbidden message that got through would have
arrived before it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from acl_clients import ensure_subscribed, marker, receive_until, settings
from harness.brokers import ConfiguredMosquitto, require_mosquitto
from coordinator.brokers.embedded import free_port
from coordinator.brokers.mosquitto import BrokerConfigError, certificate_authority, generate
from coordinator.run.folder import RunFolder
from edge_sdk.settings import load_credentials
from edge_sdk.transport import MqttTransport, TransportError

pytestmark = pytest.mark.integration

FED = "authfed"
DEVICES = ["dev000", "dev001", "dev002"]
PREFIX = f"edgepfl/{FED}"


def start(tmp_path_factory, name: str, *, tls: bool):
    require_mosquitto()
    port = free_port()
    setup = generate(tmp_path_factory.mktemp(name), FED, DEVICES, port, tls=tls)
    return setup, ConfiguredMosquitto(setup.config, port)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    setup, broker = start(tmp_path_factory, "plain", tls=False)
    with broker:
        yield setup


@pytest.fixture(scope="module")
def mutual_tls(tmp_path_factory):
    setup, broker = start(tmp_path_factory, "tls", tls=True)
    with broker:
        yield setup


def test_anonymous_connection_is_refused(plain):
    transport = MqttTransport(f"{FED}.anonymous", settings(plain, None))

    with pytest.raises(TransportError, match="refused|closed|not authori"):
        transport.connect()


def test_wrong_password_is_refused(plain):
    transport = MqttTransport(f"{FED}.intruder", settings(plain, "dev000", password="not-the-password", protocol="5"))

    with pytest.raises(TransportError):
        transport.connect()


def test_device_message_on_its_own_topic_reaches_the_coordinator(plain, connect):
    coordinator, device = connect(plain, "coordinator"), connect(plain, "dev000")
    coordinator.subscribe(f"{PREFIX}/up/+/+")
    ensure_subscribed(coordinator, device, f"{PREFIX}/up/dev000/probe")
    payload = marker()

    device.publish(f"{PREFIX}/up/dev000/train_res", payload)

    receive_until(coordinator, payload)


def test_device_cannot_publish_under_another_device_id(plain, connect):
    coordinator, device = connect(plain, "coordinator"), connect(plain, "dev000")
    coordinator.subscribe(f"{PREFIX}/up/+/+")
    ensure_subscribed(coordinator, device, f"{PREFIX}/up/dev000/probe")
    done = marker()

    device.publish(f"{PREFIX}/up/dev001/train_res", b"forged")
    device.publish(f"{PREFIX}/up/dev000/hello", done)

    assert receive_until(coordinator, done) == []


def test_device_cannot_publish_downstream(plain, connect):
    coordinator, device, other = connect(plain, "coordinator"), connect(plain, "dev000"), connect(plain, "dev001")
    coordinator.subscribe(f"{PREFIX}/up/+/+")
    other.subscribe(f"{PREFIX}/down/dev001/+")
    other.subscribe(f"{PREFIX}/down/all/+")  # subscribed last: its probe proves both are active
    ensure_subscribed(coordinator, device, f"{PREFIX}/up/dev000/probe")
    ensure_subscribed(other, coordinator, f"{PREFIX}/down/all/probe")
    first, second = marker(), marker()

    device.publish(f"{PREFIX}/down/all/train", b"forged broadcast")
    device.publish(f"{PREFIX}/down/dev001/welcome", b"forged welcome")
    device.publish(f"{PREFIX}/up/dev000/hello", first)
    receive_until(coordinator, first)  # the broker has routed (or dropped) both forgeries by now
    coordinator.publish(f"{PREFIX}/down/all/status", second)

    assert receive_until(other, second) == []


def test_device_cannot_read_another_devices_downstream_topic(plain, connect):
    coordinator, snoop, owner = connect(plain, "coordinator"), connect(plain, "dev001"), connect(plain, "dev000")
    snoop.subscribe(f"{PREFIX}/down/dev000/+")
    snoop.subscribe(f"{PREFIX}/down/all/+")
    owner.subscribe(f"{PREFIX}/down/dev000/+")
    ensure_subscribed(snoop, coordinator, f"{PREFIX}/down/all/probe")
    ensure_subscribed(owner, coordinator, f"{PREFIX}/down/dev000/probe")
    secret, done = marker(), marker()

    coordinator.publish(f"{PREFIX}/down/dev000/welcome", secret)
    coordinator.publish(f"{PREFIX}/down/all/status", done)

    receive_until(owner, secret)  # the message was delivered, to its owner only
    assert receive_until(snoop, done) == []


def test_device_cannot_knock_the_coordinator_off_with_its_client_id(plain, connect):
    coordinator = connect(plain, "coordinator")
    coordinator.subscribe(f"{PREFIX}/up/+/+")
    impostor = MqttTransport(coordinator.client_id, settings(plain, "dev000"))
    impostor.connect()  # a takeover would close the coordinator's connection during this CONNECT
    try:
        ensure_subscribed(coordinator, impostor, f"{PREFIX}/up/dev000/probe")
    finally:
        impostor.close()

    assert coordinator.connected.is_set() and coordinator.connections == 1


def test_mutual_tls_works_with_the_generated_ca(mutual_tls, connect):
    coordinator, device = connect(mutual_tls, "coordinator"), connect(mutual_tls, "dev002")
    coordinator.subscribe(f"{PREFIX}/up/+/+")
    ensure_subscribed(coordinator, device, f"{PREFIX}/up/dev002/probe")
    payload = marker()

    device.publish(f"{PREFIX}/up/dev002/eval_res", payload)

    assert mutual_tls.url.startswith("mqtts://127.0.0.1:")
    receive_until(coordinator, payload)


def test_a_device_presenting_another_devices_certificate_is_refused_that_devices_topics(mutual_tls, connect):
    # Prepare: dev001's certificate and key, with dev000's username and password
    coordinator = connect(mutual_tls, "coordinator")
    coordinator.subscribe(f"{PREFIX}/up/+/+")
    stolen = mutual_tls.accounts["dev001"]
    impostor = connect(mutual_tls, "dev000", cert_file=str(stolen.cert_file), key_file=str(stolen.key_file))
    ensure_subscribed(coordinator, impostor, f"{PREFIX}/up/dev001/probe")
    done = marker()

    # Execute: it publishes as dev000 (refused: the certificate makes it dev001), then as dev001
    impostor.publish(f"{PREFIX}/up/dev000/train_res", b"forged with a borrowed certificate")
    impostor.publish(f"{PREFIX}/up/dev001/hello", done)

    # Assert: only what the certificate's own account may publish arrived
    assert receive_until(coordinator, done) == []


def test_tls_with_an_unrelated_ca_is_refused(mutual_tls, tmp_path):
    wrong_ca = certificate_authority(tmp_path / "other-ca", "unrelated CA").cert
    transport = MqttTransport(f"{FED}.wrong-ca", settings(mutual_tls, "dev000", ca_file=str(wrong_ca), protocol="5"))

    with pytest.raises(TransportError):
        transport.connect()


def test_tls_without_a_client_certificate_is_refused(mutual_tls):
    transport = MqttTransport(f"{FED}.no-cert", settings(mutual_tls, "dev000", cert_file=None, key_file=None,
                                                                   protocol="5"))

    with pytest.raises(TransportError):
        transport.connect()


def test_credentials_file_loads_and_is_private(mutual_tls):
    path = str(mutual_tls.credentials)

    assert load_credentials(path, "coordinator") == ("coordinator", mutual_tls.accounts["coordinator"].password)
    assert load_credentials(path, "dev001") == ("dev001", mutual_tls.accounts["dev001"].password)
    document = json.loads(mutual_tls.credentials.read_text())
    assert Path(document["devices"]["dev001"]["cert_file"]).exists()
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(document["devices"]["dev001"]["key_file"]).st_mode & 0o777 == 0o600
    assert mutual_tls.accounts["dev001"].password not in mutual_tls.passwords.read_text()
    assert len(bytes.fromhex(document["devices"]["dev001"]["signing_key"])) == 32
    assert "signing_key" not in document["coordinator"]

    own = mutual_tls.out / "devices" / "dev001.json"
    assert json.loads(own.read_text())["devices"] == {"dev001": document["devices"]["dev001"]}
    assert load_credentials(str(own), "dev001") == ("dev001", mutual_tls.accounts["dev001"].password)
    assert os.stat(own).st_mode & 0o777 == 0o600


@pytest.mark.parametrize("devices, federation, port, bad", [
    ("dev000,all", FED, 1883, "'all'"),
    ("dev000,coordinator", FED, 1883, "'coordinator'"),
    ("dev000,bad/id", FED, 1883, "'bad/id'"),
    ("dev000,dev000", FED, 1883, "'dev000'"),
    ("dev000", "fed/eration", 1883, "'fed/eration'"),
    ("dev000", FED, 70000, "70000"),
])
def test_invalid_input_is_rejected_by_name(tmp_path, devices, federation, port, bad):
    with pytest.raises(BrokerConfigError, match=bad):
        generate(tmp_path, federation, devices, port)

    assert not (tmp_path / "credentials.json").exists()


def test_simulate_runs_against_the_generated_broker(plain, tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "coordinator.cli", "simulate", "--broker", plain.url, "--credentials",
               str(plain.credentials), "--federation", FED, "--clients", "3", "--rounds", "1", "--dataset", "digits",
               "--local-epochs", "1", "--workers", "1", "--registration-timeout", "60", "--round-timeout", "60",
               "--quiet", "--out", str(out)]

    result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})

    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(RunFolder(out).report.read_text())
    assert report["rounds_completed"] == 1
    assert report["rounds"][0]["participants"] == 3
    assert sum(report["rejections"].values()) == 0
