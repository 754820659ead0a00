"""The kit's end of the conversation with the device under test.

Down messages go out through the project's own `Channel` (encoding, chunking), so the device
receives exactly what a coordinator sends; what the device sends comes back through the same
channel's checks (topic, size, seal with a key, envelope). Every kind is treated as repeatable
there, so a repeated reply reaches the kit instead of being dropped as a duplicate: whether a
repeat is right is what the kit judges. HELLO and FETCH are answered as they arrive, as a
coordinator answers them (`responder`).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

from edge_sdk.channel import Channel
from edge_sdk.protocol import COORDINATOR, Envelope, Kind, new_message_id

PER_DEVICE = frozenset({Kind.WELCOME, Kind.ARTIFACT, Kind.NACK})
RETAINED = frozenset({Kind.STATUS, Kind.RELEASE})


class DevicePeer:
    """Messages to and from one device. `received` holds every envelope from it, in order."""

    def __init__(self, channel: Channel, device_id: str):
        self.channel = channel
        self.topics = channel.topics
        self.device_id = device_id
        self.responder: Callable[[Envelope], None] = lambda envelope: None
        self.received: list[Envelope] = []

    def listen(self, timeout: float = 10.0) -> None:
        """Subscribe to what the device publishes (its upstream topics only), and wait up to
        `timeout` s for the broker to grant it: a HELLO sent before would be lost."""
        transport = self.channel.transport
        transport.subscribe(f"{self.topics.prefix}/up/{self.device_id}/+")
        granted = getattr(transport, "subscriptions_active", lambda: True)
        pause = threading.Event()
        deadline = time.monotonic() + timeout
        while not granted() and time.monotonic() < deadline:
            pause.wait(0.02)

    def topic(self, kind: Kind) -> str:
        return self.topics.down(self.device_id, kind) if kind in PER_DEVICE else self.topics.broadcast(kind)

    def envelope(self, kind: Kind, run_id: str, round_: int, **fields) -> Envelope:
        return Envelope(kind, COORDINATOR, run_id=run_id, round=round_, msg_id=new_message_id(), **fields)

    def send(self, envelope: Envelope, topic: str | None = None) -> Envelope:
        """Publish `envelope` (chunked when larger than the channel's chunk size) on its kind's topic."""
        self.channel.send(topic or self.topic(envelope.kind), envelope, retain=envelope.kind in RETAINED)
        return envelope

    def publish(self, topic: str, payload: bytes) -> None:
        """Publish bytes as they are (a damaged frame, a sealed or padded message)."""
        self.channel.transport.publish(topic, payload)

    def mark(self) -> int:
        """A position in `received`, for `since` and `wait_for`."""
        return len(self.received)

    def since(self, mark: int, kind: Kind | None = None) -> list[Envelope]:
        return [e for e in self.received[mark:] if kind is None or e.kind is kind]

    def wait_for(self, match: Callable[[Envelope], bool], timeout: float, *, since: int | None = None,
                 give_up: Callable[[], bool] = lambda: False) -> Envelope | None:
        """The first envelope from the device after `since` (default: from now) that `match`es,
        waiting up to `timeout` seconds; None when none came or `give_up()` turned true."""
        start = self.mark() if since is None else since
        earlier = next((envelope for envelope in self.received[start:] if match(envelope)), None)
        if earlier is not None:
            return earlier
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not give_up():
            arrived = self._receive(min(0.5, max(0.0, deadline - time.monotonic())))
            if arrived is not None and match(arrived):
                return arrived
        return None

    def drain(self, seconds: float) -> None:
        """Take in whatever the device sends for `seconds` (the quiet window after a check)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._receive(max(0.0, deadline - time.monotonic()))

    def _receive(self, timeout: float) -> Envelope | None:
        received = self.channel.receive(timeout)
        if received is None or received.address.client_id != self.device_id:
            return None
        envelope = received.envelope
        self.received.append(envelope)
        if envelope.kind in (Kind.HELLO, Kind.FETCH):
            self.responder(envelope)
        return envelope

    def rejections(self) -> Counter[str]:
        """Messages from the device the channel rejected, by reason code."""
        return Counter(self.channel.rejections)

    def kinds(self) -> Counter[str]:
        return Counter(envelope.kind.value for envelope in self.received)
