"""A plain paho MQTT 3.1.1 client on one test host (harness/hosts.py), for the NATS cluster
tests of test_nats_cluster.py and test_nats_broker_config.py."""

from __future__ import annotations

import queue

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from harness.hosts import Hosts

WAIT = 30.0


class Probe:
    """A plain paho MQTT 3.1.1 client on one test host that waits for its CONNACK, SUBACKs and
    PUBACKs, and queues what it receives as (topic, payload, retained)."""

    def __init__(self, hosts: Hosts, host: int, url: str, client_id: str, *, clean: bool = True):
        self.hosts, self.host, self.client_id = hosts, host, client_id
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311,
                                  clean_session=clean)
        self.client.reconnect_delay_set(1, 2)
        self.messages: queue.Queue[tuple[str, bytes, bool]] = queue.Queue()
        self._connacks: queue.Queue[tuple[bool, bool]] = queue.Queue()  # CONNACK: (refused, session present)
        self._acks: queue.Queue[tuple[int, bool]] = queue.Queue()  # SUBACK: (message id, refused)
        self.client.on_connect = lambda c, u, flags, rc, p: self._connacks.put((rc.is_failure, flags.session_present))
        self.client.on_subscribe = lambda c, u, mid, codes, p: self._acks.put((mid, codes[0].is_failure))
        self.client.on_message = lambda c, u, m: self.messages.put((m.topic, bytes(m.payload), m.retain))
        self.url = url

    def connect(self) -> bool:
        """Connect (its network thread lives on the probe's host); True if a session was present."""
        host, port = self.url.removeprefix("mqtt://").split(":")
        with self.hosts.inside(self.host):
            self.client.connect(host, int(port), keepalive=10)
            self.client.loop_start()
        return self.connack()

    def connack(self, timeout: float = WAIT) -> bool:
        """The next CONNACK's session-present flag; ConnectionRefusedError if it refused the client."""
        refused, session_present = self._connacks.get(timeout=timeout)
        if refused:
            raise ConnectionRefusedError(f"{self.url} refused {self.client_id!r}")
        return session_present

    def subscribe(self, topic: str, qos: int = 1, *, granted: bool = True) -> None:
        """Subscribe and wait for the SUBACK, which must grant it (or, with `granted=False`, refuse it)."""
        _, mid = self.client.subscribe(topic, qos)
        acked, refused = self._acks.get(timeout=WAIT)
        assert acked == mid
        assert refused is not granted, f"the subscription to {topic} was {'refused' if refused else 'granted'}"

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        self.client.publish(topic, payload, qos=qos, retain=retain).wait_for_publish(WAIT)

    def next(self) -> tuple[str, bytes, bool]:
        return self.messages.get(timeout=WAIT)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
