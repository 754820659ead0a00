"""Envelopes over a transport: encode, chunk, publish; receive, reassemble, decode, check.

Both the coordinator and the devices talk through a `Channel`. Everything that arrives is
checked before anyone sees it: the topic must belong to the federation, the frame must decode,
the envelope's sender must be the device named in an upstream topic. Rejections are logged with
a reason code and counted; identical redeliveries (QoS 1) are dropped by message id.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Protocol

from . import wire
from .chunks import (DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE, Reassembler, check_chunk_size, chunk_from_dict,
                     is_chunk_frame, iter_frames)
from .counters import ByteCounter
from .flow import IncomingQueue
from .protocol import Envelope, Kind, ProtocolError, Reason, TopicAddress, Topics
from .transport import Incoming

log = logging.getLogger(__name__)

PACKET_OVERHEAD = 16
"""An MQTT PUBLISH beyond its topic and payload: fixed header, topic length, packet id, properties."""
FRAME_OVERHEAD = 256
"""A chunk frame beyond its slice (about 120 bytes, docs/PROTOCOL.md section 5), rounded up."""


class Transport(Protocol):
    """What a channel needs from a connection (MqttTransport and LoopbackTransport provide it)."""

    client_id: str
    counter: ByteCounter
    incoming: IncomingQueue

    def connect(self) -> None: ...
    def close(self) -> None: ...
    def subscribe(self, topic_filter: str, qos: int = 1) -> None: ...
    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None: ...


@dataclass(frozen=True)
class Received:
    topic: str
    address: TopicAddress
    envelope: Envelope


class Channel:
    """Sends and receives whole envelopes on one federation's topics."""

    def __init__(
        self,
        transport: Transport,
        topics: Topics,
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        limits: wire.WireLimits = wire.DEFAULT_LIMITS,
        reassembly_budget: int | None = None,
        max_pending_blobs: int = 64,
        repeatable: frozenset[Kind] = frozenset(),
    ):
        self.transport = transport
        self.topics = topics
        self.chunk_size = check_chunk_size(chunk_size)
        self.limits = limits
        self.rejections: Counter[str] = Counter()
        self.duplicates = 0
        self.repeatable = repeatable | {Kind.OFFLINE}  # passed on even when seen before
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._reassembler = Reassembler(
            max_blob_bytes=limits.max_message_bytes,
            max_pending_bytes=reassembly_budget or 2 * limits.max_message_bytes,
            max_pending_blobs=max_pending_blobs,
            on_drop=self._count_drop,
        )

    @property
    def counter(self) -> ByteCounter:
        return self.transport.counter

    def send(self, topic: str, envelope: Envelope, *, retain: bool = False) -> int:
        """Publish one envelope, chunked when larger than the chunk size or than the broker's
        maximum packet size (where an MQTT 5 broker announces one); returns bytes sent. The
        arrays are copied once, into the message or its frames made one at a time."""
        pieces = wire.encode_pieces(envelope)
        size, room = sum(len(piece) for piece in pieces), self._broker_room(topic)
        if size <= min(self.chunk_size, room):
            payload = b"".join(pieces)
            self.transport.publish(topic, payload, retain=retain)
            return size
        if retain:
            raise ValueError("retained messages must fit in one chunk")
        sent = 0
        for frame in iter_frames(pieces, max(MIN_CHUNK_SIZE, min(self.chunk_size, room - FRAME_OVERHEAD))):
            self.transport.publish(topic, frame)
            sent += len(frame)
        return sent

    def _broker_room(self, topic: str) -> int:
        """The largest payload the broker takes on `topic` (unbounded when it did not say)."""
        broker = getattr(self.transport, "max_packet_size", None)
        return MAX_CHUNK_SIZE + FRAME_OVERHEAD if broker is None else broker - len(topic.encode()) - PACKET_OVERHEAD

    def receive(self, timeout: float) -> Received | None:
        """The next valid envelope, or None when `timeout` seconds pass without one."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                incoming = self.transport.incoming.get(timeout=max(0.0, remaining))
            except queue.Empty:
                self._reassembler.expire()
                return None
            received = self._accept(incoming)
            if received is not None:
                return received
            if time.monotonic() >= deadline:
                return None

    def release(self) -> None:
        """The envelope received last is handled: under flow control, its bytes no longer hold
        back the next message (the next `receive` releases it anyway)."""
        self.transport.incoming.release()

    def _accept(self, incoming: Incoming) -> Received | None:
        topic, payload = incoming
        try:
            address = self.topics.parse(topic)
            if not payload:
                return None  # a cleared retained message
            obj = wire.unpack(payload, self.limits)
            if is_chunk_frame(obj):
                blob = self._reassembler.add(topic, chunk_from_dict(obj))
                if blob is None:
                    return None
                obj = wire.unpack(blob, self.limits)
            envelope = wire.envelope_from_dict(obj, self.limits)
            self._check_sender(address, envelope)
        except ProtocolError as err:
            self.reject(err.reason, f"{topic}: {err.detail}")
            return None
        if envelope.kind not in self.repeatable and self._is_duplicate(envelope):
            return None
        return Received(topic, address, envelope)

    def _check_sender(self, address: TopicAddress, envelope: Envelope) -> None:
        if address.kind != envelope.kind:
            raise ProtocolError(Reason.BAD_KIND, f"envelope kind {envelope.kind.value} on a {address.kind.value} topic")
        if address.direction == "up" and envelope.sender != address.client_id:
            raise ProtocolError(
                Reason.SENDER_MISMATCH, f"sender {envelope.sender!r} published on {address.client_id!r}'s topic"
            )

    def _is_duplicate(self, envelope: Envelope) -> bool:
        key = (envelope.sender, envelope.msg_id)
        if key in self._seen:
            self.duplicates += 1
            return True
        self._seen[key] = None
        if len(self._seen) > 65536:
            self._seen.popitem(last=False)
        return False

    def reject(self, reason: Reason, detail: str) -> None:
        """Count and log one rejected message; callers use it for their own checks too."""
        self.rejections[reason.value] += 1
        log.warning("rejected (%s): %s", reason.value, detail)

    def _count_drop(self, reason: Reason) -> None:
        self.reject(reason, "incomplete chunked message dropped")

