"""`edgepfl broker-config --broker-kind nats`: a 3-node NATS cluster started with the written node
configurations takes the coordinator and the devices on their own topics, refuses a device on
another device's topics (and a wrong password), and carries a federation of `edgepfl`
processes logged in with the written credentials files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from coordinator.cli import main
from coordinator.run.folder import RunFolder
from edge_sdk.protocol import Kind, Topics
from edge_sdk.transport import MqttSettings, MqttTransport
from harness.hosts import hosts_or_skip
from harness.nats_cluster import NatsCluster, nats_binary, wait_until
from nats_probe import Probe

pytestmark = pytest.mark.integration
FED = "plant-9"
DEVICES = ("cam-1", "cam-2")


@pytest.fixture
def configured(tmp_path, capsys):
    nats_binary()
    with hosts_or_skip(3) as hosts:
        nodes = ",".join(hosts.address(host) for host in (1, 2, 3))
        assert main(["broker-config", "--broker-kind", "nats", "--out", str(tmp_path / "nats"), "--federation", FED,
                     "--devices", ",".join(DEVICES), "--nodes", nodes]) == 0
        assert "nats-server -c" in capsys.readouterr().out
        cluster = NatsCluster(hosts, tmp_path / "run",
                              config=lambda host, store: tmp_path / "nats" / "nodes" / f"n{host}.conf").start()
        credentials = json.loads((tmp_path / "nats" / "credentials.json").read_text())
        yield hosts, cluster, credentials
        cluster.stop()


def probe(configured, host: int, account: str, client_id: str, password: str | None = None) -> Probe:
    hosts, cluster, credentials = configured
    entry = credentials["coordinator"] if account == "coordinator" else credentials["devices"][account]
    made = Probe(hosts, host, cluster.urls[host - 1], client_id)
    made.client.username_pw_set(account, password or entry["password"])
    return made


def test_nats_config_takes_the_coordinator_and_devices_and_refuses_other_topics(configured):
    topics = Topics(FED)
    coordinator = probe(configured, 1, "coordinator", f"{FED}.coordinator")
    device = probe(configured, 2, "cam-1", f"{FED}.cam-1")
    coordinator.connect()
    device.connect()
    try:
        coordinator.subscribe(f"{topics.prefix}/up/#")  # wider than edgepfl's up/+/+
        for subscription in topics.device_subscriptions("cam-1"):
            device.subscribe(subscription)
        device.subscribe(topics.down("cam-2", Kind.WELCOME), granted=False)
        device.subscribe(topics.all_up(), granted=False)

        coordinator.publish(topics.broadcast(Kind.STATUS), b"status", retain=True)
        coordinator.publish(topics.down("cam-1", Kind.WELCOME), b"welcome")
        device.publish(topics.up("cam-2", Kind.HELLO), b"forged")  # another device's topic: dropped
        device.publish(topics.broadcast(Kind.TRAIN), b"forged")  # the coordinator's topic: dropped
        device.publish(topics.up("cam-1", Kind.HELLO), b"hello")

        assert [device.next()[:2], device.next()[:2]] == [(topics.broadcast(Kind.STATUS), b"status"),
                                                          (topics.down("cam-1", Kind.WELCOME), b"welcome")]
        # QoS 1 from one connection arrives in order: a forged message that got through would come first
        assert coordinator.next()[:2] == (topics.up("cam-1", Kind.HELLO), b"hello")
        assert coordinator.messages.empty() and device.messages.empty()
    finally:
        coordinator.close()
        device.close()


def test_nats_config_refuses_a_wrong_password(configured):
    intruder = probe(configured, 3, "cam-2", f"{FED}.cam-2", password="not-the-password")

    try:
        with pytest.raises(ConnectionRefusedError):
            intruder.connect()
    finally:
        intruder.client.loop_stop()


def test_nats_config_refuses_dotted_ids(tmp_path):
    from coordinator.brokers.nats import generate_nats

    with pytest.raises(ValueError, match="federation name 'plant.9' has a '.'"):
        generate_nats(tmp_path, "plant.9", ["cam-1"])
    with pytest.raises(ValueError, match="device id 'cam.1' has a '.'"):
        generate_nats(tmp_path, "plant-9", ["cam.1"])


def test_edgepfl_transport_retries_a_refused_subscription(configured):
    """NATS refuses subscriptions while JetStream elects new leaders after a node died; the
    transport must not stay deaf: a refused SUBACK is retried (here it is refused for good)."""
    hosts, cluster, credentials = configured
    settings = MqttSettings(url=cluster.urls[1], username="cam-1", password=credentials["devices"]["cam-1"]["password"])
    device = MqttTransport(f"{FED}.cam-1", settings)
    with hosts.inside(2):
        device.connect()
    try:
        device.subscribe(Topics(FED).down("cam-2", Kind.WELCOME))

        wait_until(lambda: device.refused_subscriptions >= 2, 30, lambda: "the refused subscription was not retried")
        assert not device.subscriptions_active()
    finally:
        device.close()


def test_a_federation_runs_with_the_written_accounts(configured, tmp_path):
    """The real processes with their own credentials files: a coordinator on host 1 and two
    signing devices on hosts 2 and 3 finish two FedAvg rounds, every update accepted."""
    hosts, cluster, _ = configured
    setup = tmp_path / "nats"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    common = ["--federation", FED, "--mqtt-protocol", "3.1.1", "--dataset", "digits", "--clients", str(len(DEVICES))]
    devices = []
    for index, (host, device) in enumerate(zip((2, 3), DEVICES, strict=True)):
        with open(tmp_path / f"{device}.log", "w") as log:
            devices.append(hosts.spawn(host, [
                sys.executable, "-m", "coordinator.cli", "client", "--broker", cluster.urls[host - 1], *common,
                "--client-id", device, "--index", str(index),
                "--credentials", str(setup / "devices" / f"{device}.json"), "--state-dir", str(tmp_path / device),
                "--device", "cpu"], env=env, stdout=log, stderr=subprocess.STDOUT))
    with open(tmp_path / "coordinator.log", "w") as log:
        coordinator = hosts.spawn(1, [
            sys.executable, "-m", "coordinator.cli", "coordinator", "--broker", cluster.urls[0], *common,
            "--algorithm", "fedavg", "--rounds", "2", "--local-epochs", "1", "--credentials",
            str(setup / "credentials.json"), "--out", str(tmp_path / "run")], env=env, stdout=log,
            stderr=subprocess.STDOUT)
    coordinator.wait(timeout=300)
    assert coordinator.returncode == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
    for device in devices:
        device.wait(timeout=60)

    report = json.loads(RunFolder(tmp_path / "run").report.read_text())
    assert [r["participants"] for r in report["rounds"]] == [2, 2]
    assert report["rejections"] == {}
