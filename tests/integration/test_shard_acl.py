"""`edgepfl broker-config --shards 2` against a real Mosquitto: a device writes its updates to
its own shard's topic only, and a shard aggregator reads its own shard only (markers as in
test_auth.py: once a permitted marker arrived, a forbidden message routed before it would have)."""

from __future__ import annotations

import pytest

from harness.brokers import ConfiguredMosquitto, require_mosquitto
from coordinator.brokers.embedded import free_port
from coordinator.brokers.mosquitto import BrokerConfigError, generate
from coordinator.shards.sharding import shard_of
from acl_clients import ensure_subscribed, marker, receive_until

pytestmark = pytest.mark.integration

FED = "shardacl"
SHARD0, SHARD1 = "dev002", "dev000"
PREFIX = f"edgepfl/{FED}"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    require_mosquitto()
    port = free_port()
    setup = generate(tmp_path_factory.mktemp("sharded"), FED, [SHARD0, SHARD1], port, shards=2)
    with ConfiguredMosquitto(setup.config, port):
        yield setup


def test_the_example_devices_sit_in_the_shards_named():
    assert (shard_of(SHARD0, 2), shard_of(SHARD1, 2)) == (0, 1)


def test_a_device_update_on_its_shard_topic_reaches_that_shards_aggregator(sharded, connect):
    aggregator, device = connect(sharded, "aggregator-0"), connect(sharded, SHARD0)
    aggregator.subscribe(f"{PREFIX}/shard-0/+/train_res")
    ensure_subscribed(aggregator, device, f"{PREFIX}/shard-0/{SHARD0}/train_res")
    payload = marker()

    device.publish(f"{PREFIX}/shard-0/{SHARD0}/train_res", payload)

    receive_until(aggregator, payload)


def test_a_device_cannot_write_another_shard_nor_another_id(sharded, connect):
    aggregator, intruder, owner = (connect(sharded, "aggregator-0"), connect(sharded, SHARD1),
                                   connect(sharded, SHARD0))
    aggregator.subscribe(f"{PREFIX}/shard-0/+/train_res")
    ensure_subscribed(aggregator, owner, f"{PREFIX}/shard-0/{SHARD0}/train_res")
    done = marker()

    intruder.publish(f"{PREFIX}/shard-0/{SHARD1}/train_res", b"forged: not its shard")
    intruder.publish(f"{PREFIX}/shard-0/{SHARD0}/train_res", b"forged: not its id")
    intruder.publish(f"{PREFIX}/up/{SHARD1}/hello", b"routed after the forgeries")
    owner.publish(f"{PREFIX}/shard-0/{SHARD0}/train_res", done)

    assert [m for m in receive_until(aggregator, done) if len(m.payload)] == []  # (the probe's clearing is empty)


def test_an_aggregator_cannot_read_another_shard(sharded, connect):
    coordinator, snoop, owner, device = (connect(sharded, "coordinator"), connect(sharded, "aggregator-1"),
                                         connect(sharded, "aggregator-0"), connect(sharded, SHARD0))
    snoop.subscribe(f"{PREFIX}/shard-0/+/train_res")
    snoop.subscribe(f"{PREFIX}/down/all/+")
    owner.subscribe(f"{PREFIX}/shard-0/+/train_res")
    ensure_subscribed(snoop, coordinator, f"{PREFIX}/down/all/probe")
    ensure_subscribed(owner, device, f"{PREFIX}/shard-0/{SHARD0}/train_res")
    update, done = marker(), marker()

    device.publish(f"{PREFIX}/shard-0/{SHARD0}/train_res", update)
    receive_until(owner, update)  # delivered, to its shard's aggregator
    coordinator.publish(f"{PREFIX}/down/all/status", done)

    assert receive_until(snoop, done) == []


def test_a_device_id_of_an_aggregator_is_refused(tmp_path):
    with pytest.raises(BrokerConfigError, match="reserved for a shard aggregator"):
        generate(tmp_path, FED, ["aggregator-0"], free_port(), shards=2)
