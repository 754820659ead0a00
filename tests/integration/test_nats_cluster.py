"""What edgepfl relies on from its broker, across a 3-node NATS cluster on three test hosts.

Each node runs on its own network namespace (harness/hosts.py, harness/nats_cluster.py); clients
connect to different nodes from inside those hosts. Checked: retained STATUS/RELEASE-like
messages (also for a later subscriber), QoS 1 delivery, the Last Will of a killed device
process, a persistent session that gets what was published while its node was down (after
reconnecting to another node, and to the same node restarted), and a chunked broadcast larger
than the node's max_payload (1 MB). NATS speaks MQTT 3.1.1 only: edgepfl's transport, under
`protocol="auto"`, is refused MQTT 5 and falls back to 3.1.1.
"""

from __future__ import annotations

import queue
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from edge_sdk.channel import Channel
from edge_sdk.protocol import COORDINATOR, Envelope, Kind, Topics
from edge_sdk.transport import MqttSettings, MqttTransport
from harness.hosts import Hosts, hosts_or_skip
from harness.nats_cluster import MAX_PAYLOAD, NatsCluster, nats_binary
from nats_probe import WAIT, Probe

pytestmark = pytest.mark.integration
FED = "nc"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[tuple[Hosts, NatsCluster]]:
    nats_binary()
    with hosts_or_skip(3) as hosts:
        nodes = NatsCluster(hosts, tmp_path_factory.mktemp("nats")).start()
        yield hosts, nodes
        nodes.stop()


def transport_on(hosts: Hosts, host: int, url: str, client_id: str, **settings) -> MqttTransport:
    """edgepfl's own transport (protocol auto), connected from `host`."""
    transport = MqttTransport(client_id, MqttSettings(url=url, connect_timeout=WAIT, **settings))
    with hosts.inside(host):
        transport.connect()
    return transport


def test_edgepfl_transport_falls_back_to_mqtt_3_1_1(cluster):
    hosts, nodes = cluster

    transport = transport_on(hosts, 2, nodes.urls[1], "nc.fallback")

    try:
        assert transport.protocol == "3.1.1", "NATS refuses MQTT 5; auto must fall back"
    finally:
        transport.close()


def test_retained_status_on_node1_reaches_node3_also_a_later_subscriber(cluster):
    hosts, nodes = cluster
    topic = Topics(FED).broadcast(Kind.STATUS)
    coordinator = Probe(hosts, 1, nodes.urls[0], "nc.coordinator")
    early = Probe(hosts, 3, nodes.urls[2], "nc.early")
    late = Probe(hosts, 2, nodes.urls[1], "nc.late")
    coordinator.connect()
    early.connect()
    early.subscribe(topic)
    try:
        coordinator.publish(topic, b"status-1", retain=True)
        coordinator.publish(topic, b"status-2", retain=True)
        live = [early.next(), early.next()]
        late.connect()
        late.subscribe(topic)

        assert [(t, p) for t, p, _ in live] == [(topic, b"status-1"), (topic, b"status-2")]
        assert late.next() == (topic, b"status-2", True), "a later subscriber gets the last retained message"
    finally:
        for probe in (coordinator, early, late):
            probe.close()


def test_qos1_messages_cross_nodes_in_order(cluster):
    hosts, nodes = cluster
    topic = Topics(FED).up("dev7", Kind.TRAIN_RES)
    receiver = Probe(hosts, 1, nodes.urls[0], "nc.receiver")
    sender = Probe(hosts, 2, nodes.urls[1], "nc.sender")
    receiver.connect()
    receiver.subscribe(Topics(FED).all_up())
    sender.connect()
    sent = [f"update-{i}".encode() * 100 for i in range(200)]
    try:
        for payload in sent:
            sender.publish(topic, payload)
        received = [receiver.next() for _ in sent]

        assert [p for _, p, _ in received] == sent
        assert {t for t, _, _ in received} == {topic}
    finally:
        receiver.close()
        sender.close()


def line_of(process: subprocess.Popen, timeout: float = WAIT) -> str:
    """The next line `process` prints; queue.Empty after `timeout` (its stdout must be a text pipe)."""
    lines: queue.Queue[str] = queue.Queue()
    stdout = process.stdout
    assert stdout is not None
    threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
    return lines.get(timeout=timeout)


DEVICE_SCRIPT = textwrap.dedent("""
    import sys, threading
    from edge_sdk.transport import MqttSettings, MqttTransport
    url, topic = sys.argv[1:3]
    device = MqttTransport("nc.dev-will", MqttSettings(url=url, connect_timeout=30), will=(topic, b"offline"))
    device.connect()
    print("connected", flush=True)
    threading.Event().wait()
""")


def test_last_will_of_a_killed_device_on_node2_reaches_the_coordinator_on_node1(cluster):
    hosts, nodes = cluster
    will_topic = Topics(FED).up("dev-will", Kind.OFFLINE)
    coordinator = Probe(hosts, 1, nodes.urls[0], "nc.coordinator-will")
    coordinator.connect()
    coordinator.subscribe(Topics(FED).all_up())
    device = hosts.spawn(2, [sys.executable, "-c", DEVICE_SCRIPT, nodes.urls[1], will_topic],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert line_of(device).strip() == "connected"
        assert coordinator.messages.empty()

        device.kill()  # no DISCONNECT: the node sees the socket close
        device.wait(timeout=WAIT)

        assert coordinator.next() == (will_topic, b"offline", False)
    finally:
        coordinator.close()


@pytest.mark.parametrize("back_to", ["another node", "the same node restarted"])
def test_persistent_session_gets_what_was_published_while_its_node_was_down(cluster, back_to):
    hosts, nodes = cluster
    topic = Topics(FED).down(f"dev-persist-{back_to.split()[1]}", Kind.TRAIN)  # apart from the other case's
    client_id = f"nc.persist-{back_to.split()[1]}"
    device = Probe(hosts, 2, nodes.urls[1], client_id, clean=False)
    assert device.connect() is False
    device.subscribe(topic)
    coordinator = Probe(hosts, 1, nodes.urls[0], "nc.coordinator-persist")
    coordinator.connect()
    coordinator.publish(topic, b"before")
    assert device.next()[1] == b"before"
    node = nodes.node(2)
    try:
        node.stop(kill=True)
        missed = [f"while-away-{i}".encode() for i in range(5)]
        for payload in missed:
            coordinator.publish(topic, payload)  # PUBACKed: stored by the two nodes left
        if back_to == "another node":
            device.client.loop_stop()  # its own loop keeps redialling node 2: replace the client
            device = Probe(hosts, 2, nodes.urls[2], client_id, clean=False)
            assert device.connect() is True, "node 3 knows the session"
            node.start()
        else:
            node.start()  # the probe's own reconnection (every 1-2 s) finds it back
            assert device.connack(timeout=2 * WAIT) is True
        # QoS 1 is at least once: a message whose PUBACK died with node 2 ("before", or one sent
        # as it died) comes again after the session's ack wait (30 s), out of order
        received: list[bytes] = []
        while not set(missed) <= set(received) and len(received) < len(missed) + 3:
            received.append(device.messages.get(timeout=2 * WAIT)[1])

        assert sorted(set(received) & set(missed)) == missed
        assert set(received) - set(missed) <= {b"before"}, "nothing but a redelivery of the unacknowledged message"
    finally:
        node.start() if node.process is None else None
        node.wait_healthy()
        device.close()
        coordinator.close()


FAILOVER_SCRIPT = textwrap.dedent("""
    import sys
    from edge_sdk.transport import MqttSettings, MqttTransport
    url, topic = sys.argv[1:3]
    device = MqttTransport("nc.dev-failover", MqttSettings(url=url, connect_timeout=30, reconnect_max_delay=2))
    device.connect()
    device.subscribe(topic)
    while True:
        incoming = device.incoming.get()
        print(bytes(incoming.payload).decode(), device.connections, flush=True)
""")


def test_a_device_given_one_name_for_all_nodes_fails_over_to_another_node(cluster):
    """docs/SCALING.md's failover: a broker name that resolves to several nodes (here an /etc/hosts
    entry; a DNS name with several addresses in the field). The device's node is killed; its
    reconnection tries the next address, and its resubscription brings the retained status."""
    hosts, nodes = cluster
    topic = Topics(FED).broadcast(Kind.STATUS)
    hosts.add_name("nats-cluster", [nodes.node(2).address, nodes.node(3).address])
    coordinator = Probe(hosts, 1, nodes.urls[0], "nc.coordinator-failover")
    coordinator.connect()
    coordinator.publish(topic, b"before", retain=True)
    device = hosts.spawn(2, [sys.executable, "-c", FAILOVER_SCRIPT, "mqtt://nats-cluster:1883", topic],
                         stdout=subprocess.PIPE, text=True)
    node = nodes.node(2)
    try:
        assert line_of(device).split() == ["before", "1"], "first connection: node 2, the first address"
        node.stop(kill=True)
        coordinator.publish(topic, b"after", retain=True)

        assert line_of(device, 2 * WAIT).split() == ["after", "2"], "reconnected (to node 3) and resubscribed"
    finally:
        device.kill()
        coordinator.close()
        node.start()
        node.wait_healthy()


NATS_CHUNK_SIZE = 1_000_000
"""The coordinator's --chunk-size docs/SCALING.md gives for NATS's default max_payload (1 MB): a frame
is its slice plus about 122 bytes, so the default 1 MiB slices would not fit."""


def test_chunked_broadcast_larger_than_max_payload_reaches_devices_on_other_nodes(cluster):
    hosts, nodes = cluster
    topics = Topics(FED)
    weights = np.random.default_rng(0).standard_normal(3 * MAX_PAYLOAD // 4, dtype=np.float32)  # 3 MB
    devices = []
    for host, device_id in ((2, "dev-a"), (3, "dev-b")):
        transport = transport_on(hosts, host, nodes.urls[host - 1], f"{FED}.{device_id}")
        for subscription in topics.device_subscriptions(device_id):
            transport.subscribe(subscription)
        devices.append((transport, Channel(transport, topics)))
    frames = Probe(hosts, 3, nodes.urls[2], "nc.frames")
    frames.connect()
    frames.subscribe(topics.broadcast(Kind.TRAIN))
    coordinator = transport_on(hosts, 1, nodes.urls[0], f"{FED}.coordinator")
    try:
        sent = Channel(coordinator, topics, chunk_size=NATS_CHUNK_SIZE).send(topics.broadcast(Kind.TRAIN), Envelope(
            Kind.TRAIN, COORDINATOR, run_id="r", round=1, groups={"shared": {"w": weights}}))
        # a loaded machine slows JetStream's cross-node delivery of the 3 MB in frames: once 30 s fell short
        received = [channel.receive(3 * WAIT) for _, channel in devices]
        sizes = [len(frames.next()[1]) for _ in range(-(-sent // NATS_CHUNK_SIZE))]

        assert sent > MAX_PAYLOAD and len(sizes) >= 3
        assert max(sizes) <= MAX_PAYLOAD, "every frame fits the node's max_payload"
        for item in received:
            assert item is not None and item.envelope.kind is Kind.TRAIN
            np.testing.assert_array_equal(item.envelope.groups["shared"]["w"], weights)
    finally:
        frames.close()
        coordinator.close()
        for transport, _ in devices:
            transport.close()
