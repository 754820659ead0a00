"""`edgepfl broker-config --broker-kind nats` without a server: subjects, permissions, node files."""

from __future__ import annotations

import json
import stat

import pytest

from coordinator.brokers.mosquitto import BrokerConfigError
from coordinator.brokers.nats import MQTT_DELIVERY, generate_nats, hash_password, permissions, subject
from coordinator.shards.sharding import shard_of


def test_mqtt_topics_become_nats_subjects():
    assert subject("edgepfl/plant7/up/cam-1/#") == "edgepfl.plant7.up.cam-1.>"
    assert subject("edgepfl/plant7/up/+/+") == "edgepfl.plant7.up.*.*"


def test_permissions_equal_the_mosquitto_acl_plus_qos1_delivery():
    coordinator, device = permissions("plant7", "coordinator"), permissions("plant7", "cam-1")

    assert coordinator == {"publish": ["edgepfl.plant7.down", "edgepfl.plant7.down.>"],
                           "subscribe": ["edgepfl.plant7.up", "edgepfl.plant7.up.>", MQTT_DELIVERY]}
    assert device == {"publish": ["edgepfl.plant7.up.cam-1", "edgepfl.plant7.up.cam-1.>"],
                      "subscribe": ["edgepfl.plant7.down.all", "edgepfl.plant7.down.all.>",
                                    "edgepfl.plant7.down.cam-1", "edgepfl.plant7.down.cam-1.>", MQTT_DELIVERY]}


def test_with_shards_a_device_writes_its_shard_topic_and_an_aggregator_reads_its_shard():
    shard = shard_of("cam-1", 2)

    device = permissions("plant7", "cam-1", shards=2)
    aggregator = permissions("plant7", f"aggregator-{shard}", shards=2)

    assert f"edgepfl.plant7.shard-{shard}.cam-1.train_res" in device["publish"]
    assert not any(".shard-" in s for s in device["subscribe"])
    assert f"edgepfl.plant7.shard-{shard}.*.train_res" in aggregator["subscribe"]
    assert f"edgepfl.plant7.shard-{1 - shard}.*.train_res" not in aggregator["subscribe"]


def test_shards_add_the_aggregator_accounts_and_refuse_a_reserved_device_id(tmp_path):
    setup = generate_nats(tmp_path / "a", "plant7", "cam-1", 1884, shards=2)

    assert set(json.loads(setup.credentials.read_text())["devices"]) == {"cam-1", "aggregator-0", "aggregator-1"}
    with pytest.raises(BrokerConfigError, match="reserved for a shard aggregator"):
        generate_nats(tmp_path / "b", "plant7", "aggregator-0", 1884, shards=1)


def test_one_node_file_per_address_with_routes_to_the_others(tmp_path):
    nodes = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]

    setup = generate_nats(tmp_path, "plant7", "cam-1,cam-2", 1884, nodes=nodes)

    assert [p.name for p in setup.node_configs] == ["n1.conf", "n2.conf", "n3.conf"]
    second = setup.node_configs[1].read_text()
    assert "server_name: n2" in second and "listen: 10.0.0.2:1884" in second and "stream_replicas: 3" in second
    assert "@10.0.0.1:6222" in second and "@10.0.0.3:6222" in second and "@10.0.0.2:6222" not in second
    assert "include ../accounts.conf" in second
    accounts = setup.accounts_file.read_text()
    assert all(f'"{name}"' in accounts for name in ("coordinator", "cam-1", "cam-2"))
    if hash_password("x") != "x":  # Python's crypt has bcrypt here
        assert setup.accounts["cam-1"].password not in accounts
    assert stat.S_IMODE(setup.accounts_file.stat().st_mode) == 0o600
    credentials = json.loads(setup.credentials.read_text())
    assert credentials["url"] == "mqtt://10.0.0.1:1884" and set(credentials["devices"]) == {"cam-1", "cam-2"}


def test_a_single_node_has_no_cluster_block(tmp_path):
    setup = generate_nats(tmp_path, "plant7", ["cam-1"])

    assert "cluster {" not in setup.node_configs[0].read_text()
    assert "stream_replicas: 1" in setup.node_configs[0].read_text()


@pytest.mark.parametrize("federation, devices, nodes, message", [
    ("plant.7", ["cam-1"], ["10.0.0.1"], "federation name 'plant.7' has a '.'"),
    ("plant7", ["cam.1"], ["10.0.0.1"], "device id 'cam.1' has a '.'"),
    ("plant7", ["cam-1"], ["10.0.0.1", "10.0.0.1"], "listed twice"),
    ("plant7", ["cam-1"], ["10.0.0.1:4222"], "--nodes must be"),
])
def test_bad_arguments_are_named(tmp_path, federation, devices, nodes, message):
    with pytest.raises(BrokerConfigError, match=message.replace(".", r"\.")):
        generate_nats(tmp_path, federation, devices, nodes=nodes)
