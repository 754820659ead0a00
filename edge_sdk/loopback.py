"""An in-memory stand-in for an MQTT broker, for unit tests of pure round logic.

It routes bytes between `LoopbackTransport`s with MQTT topic matching, retained messages and
Last Will, and exposes the same interface as `MqttTransport`, so the code under test still
encodes and decodes every message: the wire stays a real boundary.
"""

from __future__ import annotations

import threading

from .counters import ByteCounter
from .flow import IncomingQueue
from .transport import Incoming


def topic_matches(topic_filter: str, topic: str) -> bool:
    """MQTT filter matching with `+` (one level) and `#` (the rest)."""
    filter_parts, topic_parts = topic_filter.split("/"), topic.split("/")
    for i, part in enumerate(filter_parts):
        if part == "#":
            return True
        if i >= len(topic_parts) or (part != "+" and part != topic_parts[i]):
            return False
    return len(filter_parts) == len(topic_parts)


class LoopbackBroker:
    """Delivers published payloads to every connected transport with a matching subscription."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clients: dict[str, LoopbackTransport] = {}
        self._retained: dict[str, bytes] = {}

    def transport(self, client_id: str, *, will: tuple[str, bytes] | None = None,
                  counter: ByteCounter | None = None) -> LoopbackTransport:
        return LoopbackTransport(self, client_id, will=will, counter=counter)

    def _attach(self, client: LoopbackTransport) -> None:
        with self._lock:
            self._clients[client.client_id] = client

    def _detach(self, client: LoopbackTransport, *, send_will: bool) -> None:
        with self._lock:
            self._clients.pop(client.client_id, None)
        if send_will and client.will is not None:
            self.route(*client.will, retain=False)

    def _subscribed(self, client: LoopbackTransport, topic_filter: str) -> None:
        with self._lock:
            retained = [(t, p) for t, p in self._retained.items() if topic_matches(topic_filter, t)]
        for topic, payload in retained:
            client.deliver(topic, payload)

    def route(self, topic: str, payload: bytes, *, retain: bool) -> None:
        with self._lock:
            if retain:
                if payload:
                    self._retained[topic] = payload
                else:
                    self._retained.pop(topic, None)
            targets = [c for c in self._clients.values() if c.wants(topic)]
        for client in targets:
            client.deliver(topic, payload)

    def kill(self, client_id: str) -> None:
        """Drop a client as if its process died: its Last Will is published."""
        with self._lock:
            client = self._clients.get(client_id)
        if client is not None:
            client.connected.clear()
            self._detach(client, send_will=True)


class LoopbackTransport:
    """Same surface as `MqttTransport`: connect, subscribe, publish, incoming, close."""

    def __init__(self, broker: LoopbackBroker, client_id: str, *, will: tuple[str, bytes] | None = None,
                 counter: ByteCounter | None = None):
        self.broker = broker
        self.client_id = client_id
        self.will = will
        self.counter = counter or ByteCounter()
        self.incoming = IncomingQueue(max_items=0)
        self.connected = threading.Event()
        self.connections = 1  # counted up by `reconnect`, as MqttTransport counts its connections
        self._filters: list[str] = []

    def connect(self) -> None:
        self.broker._attach(self)
        self.connected.set()

    def close(self) -> None:
        self.connected.clear()
        self.broker._detach(self, send_will=False)

    def drop_connection(self) -> None:
        """Lose the connection as a crashed client does: the broker publishes its Last Will."""
        self.broker.kill(self.client_id)

    def reconnect(self) -> None:
        """A new connection after `drop_connection`, as MqttTransport makes one: `connections`
        counted up and the subscriptions made again (their retained messages delivered)."""
        self.connect()
        self.connections += 1
        for topic_filter in self._filters:
            self.broker._subscribed(self, topic_filter)

    def subscribe(self, topic_filter: str, qos: int = 1) -> None:
        if topic_filter not in self._filters:  # a SUBSCRIBE of a filter held replaces it (retained re-sent)
            self._filters.append(topic_filter)
        if self.connected.is_set():
            self.broker._subscribed(self, topic_filter)

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        if not self.connected.is_set():
            return  # a dead or closed client's messages go nowhere
        self.counter.record("sent", topic, len(payload))
        self.broker.route(topic, payload, retain=retain)

    def wants(self, topic: str) -> bool:
        return any(topic_matches(f, topic) for f in self._filters)

    def deliver(self, topic: str, payload: bytes) -> None:
        self.counter.record("received", topic, len(payload))
        self.incoming.put(Incoming(topic, payload))
