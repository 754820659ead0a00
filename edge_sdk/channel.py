"""Envelopes over a transport: encode, chunk, publish; receive, reassemble, decode, check.

Both the coordinator and the devices talk through a `Channel`. Everything that arrives is
checked before anyone sees it: the topic must belong to the federation, the frame must decode,
the envelope's sender must be the device named in an upstream topic, and, with a `verifier`,
an upstream message must be sealed with that device's key (checked before its arrays are
decoded; `signing.py`). A channel with a `signer` seals everything it sends.

Under a flood, junk must not cost work nor delay anyone else's message. The channel screens
every upstream message on the network thread, before it is queued: the topic, the size limit
of its kind (`WireLimits.for_kind`), the sender's seal (with a `verifier`; a replayed seal is a
duplicate) and the sender's `SenderBudget` for the round; what fails is dropped unread. What
passes waits in one queue per sender, and `receive` takes the senders in turn (`flow.py`).

Rejections are logged with a reason code and counted; identical redeliveries (QoS 1) are
dropped by message id.

`Channel.counters` is the public view of what a channel did (envelopes and their bytes by
direction and kind, rejections by reason, duplicates, time spent sending and accepting, the
reassembly backlog): benchmarks and tests read it instead of wrapping the channel's methods.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from . import signing, wire
from .chunks import (DEFAULT_CHUNK_SIZE, FRAME_PREFIX, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE, Reassembler, check_chunk_size,
                     chunk_from_dict, is_chunk_frame, iter_frames)
from .counters import ByteCounter
from .flow import IncomingQueue
from .protocol import COORDINATOR, Envelope, Kind, ProtocolError, Reason, TopicAddress, Topics
from .signing import Signer, Verifier
from .transport import Incoming

log = logging.getLogger(__name__)

PACKET_OVERHEAD = 16
"""An MQTT PUBLISH beyond its topic and payload: fixed header, topic length, packet id, properties."""
FRAME_OVERHEAD = 256
"""A chunk frame beyond its slice (about 120 bytes, docs/PROTOCOL.md section 5), rounded up."""


@dataclass(frozen=True)
class SenderBudget:
    """What one sender may have taken in per round (from one TRAIN broadcast to the next) on
    its upstream topics, counted before decoding; beyond it its messages are dropped unread
    (`over_budget`). Chunk frames count in bytes only (a large upload may take many). With
    signing, only messages that carry the sender's valid seal count, so a forger cannot spend a
    device's budget."""

    messages: int = 1024
    bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if self.messages < 1 or self.bytes < 1:
            raise ValueError("SenderBudget.messages and .bytes must be positive")


class Screened(NamedTuple):
    """A message the network thread already opened: `body` is its verified envelope bytes."""

    topic: str
    payload: bytes | memoryview
    body: memoryview


def sender_of(incoming: Incoming) -> str:
    """Who published a message, the key of the receive queue's fair order: the device id of an
    upstream or shard topic (`edgepfl/<fed>/up/<id>/<kind>`, `edgepfl/<fed>/shard-<k>/<id>/<kind>`);
    the coordinator for everything else, so downstream messages keep their order across topics."""
    parts = incoming.topic.split("/", 4)
    return parts[3] if len(parts) > 3 and parts[2] != "down" else COORDINATOR


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
    """One accepted envelope, where it came from and its encoded size (reassembled, if chunked)."""

    topic: str
    address: TopicAddress
    envelope: Envelope
    size: int


@dataclass(frozen=True)
class ChannelSnapshot:
    """The counters of a channel at one moment; `a - b` is what happened between two moments
    (the reassembly peaks are those of the later one)."""

    messages: dict[str, dict[str, int]]
    """Envelopes by direction ("sent", "received") and message kind."""
    bytes: dict[str, dict[str, int]]
    """Encoded envelope bytes (before chunking, after reassembly) by direction and kind."""
    rejections: dict[str, int]
    duplicates: int
    send_seconds: float
    """Encoding, chunking and publish calls."""
    accept_seconds: float
    """Unpacking, reassembly, decoding and the checks of everything received."""
    peak_pending_blobs: int
    peak_pending_bytes: int

    def __sub__(self, earlier: ChannelSnapshot) -> ChannelSnapshot:
        def minus(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
            return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}

        return ChannelSnapshot(
            {d: minus(k, earlier.messages.get(d, {})) for d, k in self.messages.items()},
            {d: minus(k, earlier.bytes.get(d, {})) for d, k in self.bytes.items()},
            minus(self.rejections, earlier.rejections),
            self.duplicates - earlier.duplicates,
            self.send_seconds - earlier.send_seconds,
            self.accept_seconds - earlier.accept_seconds,
            self.peak_pending_blobs,
            self.peak_pending_bytes,
        )


@dataclass
class ChannelCounters:
    """Live tallies of one channel, updated by the channel only; read them or `snapshot()`."""

    messages: Counter[tuple[str, str]] = field(default_factory=Counter)
    bytes: Counter[tuple[str, str]] = field(default_factory=Counter)
    rejections: Counter[str] = field(default_factory=Counter)
    duplicates: int = 0
    send_seconds: float = 0.0
    accept_seconds: float = 0.0
    peak_pending_blobs: int = 0
    peak_pending_bytes: int = 0

    def record(self, direction: str, kind: Kind, size: int) -> None:
        self.messages[(direction, kind.value)] += 1
        self.bytes[(direction, kind.value)] += size

    def reset_peaks(self) -> None:
        """Start measuring the reassembly peaks afresh (e.g. at the start of a round)."""
        self.peak_pending_blobs = self.peak_pending_bytes = 0

    def snapshot(self) -> ChannelSnapshot:
        def by_direction(counts: Counter[tuple[str, str]]) -> dict[str, dict[str, int]]:
            out: dict[str, dict[str, int]] = {"sent": {}, "received": {}}
            for (direction, kind), n in sorted(counts.items()):
                out[direction][kind] = n
            return out

        return ChannelSnapshot(by_direction(self.messages), by_direction(self.bytes), dict(self.rejections),
                               self.duplicates, self.send_seconds, self.accept_seconds,
                               self.peak_pending_blobs, self.peak_pending_bytes)


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
        signer: Signer | None = None,
        verifier: Verifier | None = None,
        sender_budget: SenderBudget = SenderBudget(),
    ):
        self.transport = transport
        self.topics = topics
        self.chunk_size = check_chunk_size(chunk_size)
        self.limits = limits
        self.counters = ChannelCounters()
        self.signer = signer
        self.verifier = verifier
        self.sender_budget = sender_budget
        self._spent: dict[str, list[int]] = {}  # sender -> [messages, bytes] this round
        self._seen_seals: OrderedDict[bytes, None] = OrderedDict()
        self._tally = threading.Lock()  # the network thread counts rejections too
        self.repeatable = repeatable | {Kind.OFFLINE}  # passed on even when seen before
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._reassembler = Reassembler(
            max_blob_bytes=limits.max_message_bytes,
            max_pending_bytes=reassembly_budget or 2 * limits.max_message_bytes,
            max_pending_blobs=max_pending_blobs,
            on_drop=self._count_drop,
        )
        transport.incoming.screen = self._screen
        transport.incoming.fair_by = sender_of

    @property
    def counter(self) -> ByteCounter:
        """The transport's bytes on the wire (topics and chunk frames included), by kind."""
        return self.transport.counter

    @property
    def rejections(self) -> Counter[str]:
        """Rejected messages by reason code (read-only view of `counters.rejections`)."""
        return self.counters.rejections

    @property
    def duplicates(self) -> int:
        """Redelivered or repeated messages dropped."""
        return self.counters.duplicates

    @property
    def reassembly_limits(self) -> dict[str, int]:
        """The most partly received blobs, and bytes, this channel holds before dropping the oldest."""
        return {"max_pending_blobs": self._reassembler.max_pending_blobs,
                "max_pending_bytes": self._reassembler.max_pending_bytes}

    def send(self, topic: str, envelope: Envelope, *, retain: bool = False) -> int:
        """Publish one envelope, chunked when larger than the chunk size or than the broker's
        maximum packet size (where an MQTT 5 broker announces one); returns bytes sent. The
        arrays are copied once, into the message or its frames made one at a time."""
        started = time.perf_counter()
        try:
            size, sent = self._send(topic, envelope, retain)
        finally:
            self.counters.send_seconds += time.perf_counter() - started
        self.counters.record("sent", envelope.kind, size)
        if envelope.kind is Kind.TRAIN:
            self.renew_budgets()
        return sent

    def renew_budgets(self) -> None:
        """A new round: every sender's budget renews (on sending TRAIN, and on the network thread
        on receiving one: a shard aggregator takes in updates but sends no TRAIN)."""
        self._spent = {}

    def _send(self, topic: str, envelope: Envelope, retain: bool) -> tuple[int, int]:
        """(the encoded envelope's size, the bytes published: its frames' when chunked)."""
        pieces = wire.encode_pieces(envelope)
        if self.signer is not None:
            pieces = self.signer.seal(pieces)
        size, room = sum(len(piece) for piece in pieces), self._broker_room(topic)
        if size <= min(self.chunk_size, room):
            payload = b"".join(pieces)
            self.transport.publish(topic, payload, retain=retain)
            return size, size
        if retain:
            raise ValueError("retained messages must fit in one chunk")
        sent = 0
        for frame in iter_frames(pieces, max(MIN_CHUNK_SIZE, min(self.chunk_size, room - FRAME_OVERHEAD))):
            self.transport.publish(topic, frame)
            sent += len(frame)
        return size, sent

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
            started = time.perf_counter()
            try:
                received = self._accept(incoming)
            finally:
                self.counters.accept_seconds += time.perf_counter() - started
            if received is not None:
                return received
            if time.monotonic() >= deadline:
                return None

    def release(self) -> None:
        """The envelope received last is handled: under flow control, its bytes no longer hold
        back the next message (the next `receive` releases it anyway)."""
        self.transport.incoming.release()

    def _screen(self, incoming: Incoming) -> Incoming | Screened | None:
        """Network thread, before the message is queued: drop what fails the checks that need
        no decoding (topic, the size limit of its kind, the sender's seal, its budget)."""
        topic, payload = incoming
        try:
            address = self.topics.parse(topic)
            if address.direction != "up" or not payload:
                if address.kind is Kind.TRAIN and payload:
                    self.renew_budgets()  # before any reply to it can arrive on this connection
                return incoming
            limit = self.limits.for_kind(address.kind)
            if len(payload) > limit:
                raise ProtocolError(Reason.TOO_LARGE, f"{len(payload)} bytes, the limit of a {address.kind.value} "
                                                      f"is {limit}")
            body, frame = None, bytes(payload[:len(FRAME_PREFIX)]) == FRAME_PREFIX
            if self.verifier is not None and not frame:
                body = self.verifier.open_message(address.client_id, payload)
                if address.kind not in self.repeatable and self._seal_seen(payload):
                    self.count_duplicate()
                    return None
            self._charge(address.client_id, 0 if frame else 1, len(payload))
        except ProtocolError as err:
            self.reject(err.reason, f"{topic}: {err.detail}")
            return None
        return incoming if body is None else Screened(topic, payload, body)

    def _seal_seen(self, payload: bytes | memoryview) -> bool:
        """A replay of a sealed message already taken in (its MAC, at a fixed offset, names it)."""
        start = len(signing.SEALED_PREFIX)
        mac = bytes(payload[start:start + signing.KEY_BYTES])
        if mac in self._seen_seals:
            return True
        self._seen_seals[mac] = None
        if len(self._seen_seals) > 65536:
            self._seen_seals.popitem(last=False)
        return False

    def _charge(self, sender: str, messages: int, size: int) -> None:
        spent = self._spent.setdefault(sender, [0, 0])
        budget = self.sender_budget
        if spent[0] + messages > budget.messages or spent[1] + size > budget.bytes:
            raise ProtocolError(Reason.OVER_BUDGET, f"{sender} sent more than {budget.messages} messages or "
                                                    f"{budget.bytes} bytes this round")
        spent[0] += messages
        spent[1] += size

    def _accept(self, incoming: Incoming | Screened) -> Received | None:
        topic, payload = incoming.topic, incoming.payload
        try:
            address = self.topics.parse(topic)
            if not payload:
                return None  # a cleared retained message
            if isinstance(incoming, Screened):
                obj, size = wire.unpack(incoming.body, self.limits), len(payload)
            else:
                whole = self._whole(topic, address, payload)
                if whole is None:
                    return None
                obj, size = self._open(address, *whole), len(whole[0])
            envelope = wire.envelope_from_dict(obj, self.limits)
            self._check_sender(address, envelope)
        except ProtocolError as err:
            self.reject(err.reason, f"{topic}: {err.detail}")
            return None
        if envelope.kind not in self.repeatable and self._is_duplicate(envelope):
            return None
        self.counters.record("received", envelope.kind, size)
        return Received(topic, address, envelope, size)

    def _whole(self, topic: str, address: TopicAddress,
               payload: bytes | memoryview) -> tuple[bytes | memoryview, dict[str, Any]] | None:
        """(the whole message, its unpacked map): the payload itself, or the blob its chunk
        frames make once the last one arrives (None until then)."""
        obj = wire.unpack(payload, self.limits)
        if not is_chunk_frame(obj):
            return payload, obj
        chunk = chunk_from_dict(obj)
        blob = self._reassembler.add(topic, chunk, limit=self.limits.for_kind(address.kind))
        self._note_backlog()
        return None if blob is None else (blob, wire.unpack(blob, self.limits))

    def _open(self, address: TopicAddress, message: bytes | memoryview, obj: dict[str, Any]) -> dict[str, Any]:
        """The envelope's map: verified against the sender's key where this side holds keys,
        unwrapped unverified where it holds none."""
        if self.verifier is not None and address.direction == "up":
            return wire.unpack(self.verifier.open_message(address.client_id, message), self.limits)
        if signing.is_sealed(obj):
            return wire.unpack(signing.unseal(obj, address.client_id)[0], self.limits)
        return obj

    def _note_backlog(self) -> None:
        counters, reassembler = self.counters, self._reassembler
        counters.peak_pending_blobs = max(counters.peak_pending_blobs, reassembler.pending_blobs)
        counters.peak_pending_bytes = max(counters.peak_pending_bytes, reassembler.pending_bytes)

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
            self.count_duplicate()
            return True
        self._seen[key] = None
        if len(self._seen) > 65536:
            self._seen.popitem(last=False)
        return False

    def count_duplicate(self) -> None:
        """Count one message dropped as a repeat; callers use it for their own checks too."""
        with self._tally:
            self.counters.duplicates += 1

    def reject(self, reason: Reason, detail: str) -> None:
        """Count and log one rejected message; callers use it for their own checks too."""
        with self._tally:
            self.counters.rejections[reason.value] += 1
        log.warning("rejected (%s): %s", reason.value, detail)

    def _count_drop(self, reason: Reason) -> None:
        self.reject(reason, "incomplete chunked message dropped")

