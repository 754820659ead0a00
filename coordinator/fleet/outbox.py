"""What the coordinator says to devices, said from one place.

Every part of the coordinator (the round loop, registration, sharded rounds) publishes through
an `Outbox`: it sends an envelope and counts what the broker delivers of it (a broadcast
reaches every online registered device, a device's own topic one), and it refuses a message:
the reason is counted and logged, and a sender registered with this coordinator process learns
why with a NACK (`coordinator.fleet.nacks`). `RunPosition` is what every envelope the coordinator
sends says about the run: its id and the rounds completed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from edge_sdk.channel import Channel
from edge_sdk.protocol import Envelope, Kind, Reason

from ..run.ledger import Ledger
from .devices import DeviceRegistry
from .nacks import NackLimiter, nack_for


@dataclass
class RunPosition:
    """The run this coordinator plays and how many of its rounds are completed (checkpointed)."""

    run_id: str
    completed: int = 0


def resent(request: Envelope) -> Envelope:
    """`request` to publish again after a broker reconnection: the same msg_id (a device that
    answered it answers again with its cached reply) and a later timestamp, so that its bytes, and
    a chunked copy's blob id, differ from the first copy's: a receiver that completed the first
    blob drops stray duplicates of its frames, not a request sent anew."""
    return replace(request, timestamp=max(time.time(), request.timestamp + 1e-3))


class Outbox:
    """Publishes for the coordinator, counting deliveries; refuses messages, answering registered senders."""

    def __init__(self, channel: Channel, registry: DeviceRegistry, ledger: Ledger, position: RunPosition,
                 nacks: NackLimiter):
        self.channel = channel
        self.topics = channel.topics
        self.registry = registry
        self.ledger = ledger
        self.position = position
        self.nacks = nacks

    def send(self, topic: str, envelope: Envelope, *, retain: bool = False) -> None:
        """Publish, counting what the broker delivers: a broadcast reaches every online
        registered device (devices subscribe to every broadcast kind), a device's own topic one."""
        before = self.channel.counter.snapshot()[0]
        self.channel.send(topic, envelope, retain=retain)
        published = self.channel.counter.snapshot()[0] - before
        broadcast = topic == self.topics.broadcast(envelope.kind)
        self.ledger.count_delivered(envelope.kind.value, published * (len(self.registry.online()) if broadcast else 1))

    def reject(self, envelope: Envelope, reason: Reason, detail: str) -> None:
        """Count and log a refused message; a sender registered with this process learns why
        (a NACK on its own downstream topic, rate-limited: `coordinator.fleet.nacks`)."""
        self.refuse(envelope.sender, envelope.kind, envelope.msg_id, reason, detail)

    def refuse(self, sender: str, kind: Kind, msg_id: str, reason: Reason, detail: str) -> None:
        """`reject` for a message known by its sender, kind and msg_id only (one a shard
        aggregator refused and named in its NOTE)."""
        self.channel.reject(reason, detail)
        if sender in self.registry.devices and self.nacks.allow(sender, kind, reason):
            self.send(self.topics.down(sender, Kind.NACK),
                      nack_for(kind, msg_id, reason, run_id=self.position.run_id, round_=self.position.completed))
