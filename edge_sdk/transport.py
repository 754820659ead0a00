"""MQTT transport on paho-mqtt 2.x: the only module that imports paho.

Callbacks never raise: received messages are handed to a queue that the owner's thread
consumes (`flow.IncomingQueue`); the message callback blocks only when that queue is bounded in
bytes and full, which is how a receiver holds its backlog back at the broker. Subscriptions are
remembered and renewed on every (re)connection; paho reconnects with exponential backoff. MQTT
5 is used where the broker speaks it and 3.1.1 otherwise (`protocol="auto"` tries 5 first).

A subscription the broker refuses in its SUBACK is tried again with backoff (1 s doubling to
`RETRY_MAX_DELAY`) while the connection lasts, and again on every reconnection: a clustered
broker (NATS) refuses subscriptions for the seconds its JetStream needs to elect new leaders
after a node died; paho alone would leave the client deaf without a word. A refusal for lack of
authorization (MQTT 5) under `give_up_when_denied` sets `failed` instead.

Failing clearly: the first connection is retried with backoff while the broker is unreachable
(`MqttSettings.retry_first_connect`), and every failure is one line naming its cause and fix
(`BrokerUnreachable`, `NotAuthorized`, a TLS mismatch). A broker that refuses this account
(CONNACK) or denies its publications (an ACL: PUBACK "not authorized" under MQTT 5, or, under
3.1.1, which has no such answer, a connection closed right after it was made, again and again)
is not reconnected to forever: `failed` is set and `failure` says why.

Closing flushes: `close` first waits (up to `FLUSH_SECONDS`) until the broker acknowledged every
QoS 1 publication, those paho still holds back behind its in-flight window included, so a
process that publishes its last message and exits (the coordinator's final STATUS) loses none.

A simulated fleet's devices go offline and come back (`drop_connection`, `reconnect`; see
coordinator/hosting/availability.py): the connection ends without a DISCONNECT, as when a device loses
its network, so the broker publishes its Last Will; until `reconnect` nothing is received and
publications are dropped (counted in `dropped_offline`), as a device without network loses them.

Received payloads are read-only views of the buffer paho read the packet into, not copies:
paho's own PUBLISH decoder slices the packet three or four times (each a full copy), so a 4 MB
update briefly took 16 MB; `decode_publish_in_place` replaces it (paho 2.2; a paho without
`_packet.decode_publish` keeps its own decoder and copies). Reads from the socket are capped at
`READ_SIZE`: paho asks for the rest of a packet at once and keeps that buffer while the message
is handled, a second copy of every large message. Large packets are written from a view: paho
copies what is left of a packet for every socket write, quadratic in a 50 MB message's size.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import socket
import ssl
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple
from urllib.parse import urlparse

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.exception import MalformedPacket
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties, VariableByteIntegers

from .counters import ByteCounter
from .flow import IncomingQueue

try:
    from paho.mqtt import _packet
except ImportError:  # an older paho decodes PUBLISH inside the client (with its copies)
    _packet = None  # type: ignore[assignment]  # checked for None before use

log = logging.getLogger(__name__)

PROTOCOLS = {"5": mqtt.MQTTv5, "3.1.1": mqtt.MQTTv311}
READ_SIZE = 256 << 10
REFUSALS = {"Bad user name or password": "bad username or password", "Not authorized": "not authorized"}
"""CONNACK reason codes (by name, as paho reports both MQTT versions) that no retry can cure."""
BRIEF_CONNECTION = 5.0
"""A connection the broker closes within this many seconds of accepting it counts as brief."""
BRIEF_CONNECTIONS_IN_A_ROW = 5
"""So many brief connections in a row: the broker (most often its ACL) will not have this client."""
RETRY_MAX_DELAY = 10.0
FLUSH_SECONDS = 10.0
"""How long `close` waits for the broker to acknowledge what was published at QoS 1 (a last
STATUS, a last reply), so that a process that publishes and exits loses nothing in flight."""
MAX_TRACKED_PUBLICATIONS = 1024


def _settled(info: mqtt.MQTTMessageInfo) -> bool:
    """A QoS 1 publication the broker acknowledged, or one paho could not send (published while
    disconnected: paho's `is_published` raises for it), which nothing will acknowledge."""
    try:
        return info.is_published()
    except (RuntimeError, ValueError):
        return True


class TransportError(ConnectionError):
    """The broker could not be reached or refused the connection."""


class BrokerUnreachable(TransportError):
    """Nothing answered at the broker's address (not up yet, or a wrong address): worth retrying."""


class NotAuthorized(TransportError):
    """The broker refused this account or denied its publications: retrying cannot help."""


class Incoming(NamedTuple):
    topic: str
    payload: bytes | memoryview  # read-only


def decode_publish_in_place(header: int, packet: bytes | bytearray,
                            protocol: MQTTProtocolVersion) -> _packet.PublishPacket:
    """paho's `_packet.decode_publish` without copying the payload: the payload is a read-only
    view of `packet`, which paho replaces (never modifies) once the message is handled."""
    view = memoryview(packet).toreadonly()
    topic_end = 2 + int.from_bytes(view[:2], "big")
    if len(view) < topic_end:
        raise MalformedPacket("PUBLISH shorter than its topic")
    topic = bytes(view[2:topic_end])
    if protocol != MQTTProtocolVersion.MQTTv5 and not topic:
        raise MalformedPacket("topic can't be empty in MQTTv3")
    qos, position, mid = (header & 0x06) >> 1, topic_end, 0
    if qos > 0:
        if len(view) < position + 2:
            raise MalformedPacket("PUBLISH without a packet identifier")
        mid, position = int.from_bytes(view[position : position + 2], "big"), position + 2
    properties = None
    if protocol == MQTTProtocolVersion.MQTTv5:
        properties = Properties(PacketTypes.PUBLISH)
        length, width = VariableByteIntegers.decode(bytes(view[position : position + 4]))
        _, used = properties.unpack(bytes(view[position : position + width + length]))
        position += used
    return _packet.PublishPacket(dup=bool(header & 0x08), qos=qos, retain=bool(header & 0x01), topic=topic,
                                 mid=mid, properties=properties,
                                 payload=view[position:])  # type: ignore[arg-type]  # a view: paho only reads it


if _packet is not None and hasattr(_packet, "decode_publish"):
    decode_publish_in_place = _packet.convert_exception(decode_publish_in_place)
    _packet.decode_publish = decode_publish_in_place


@dataclass
class MqttSettings:
    """How to reach the broker. `url` is mqtt://host:port or mqtts://host:port (TLS)."""

    url: str = "mqtt://127.0.0.1:1883"
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    protocol: str = "auto"
    keepalive: int = 30
    connect_timeout: float = 15.0
    """Seconds one connection attempt waits for CONNACK."""
    retry_first_connect: float = 0.0
    """Seconds to keep retrying the first connection while the broker is unreachable (0: one try)."""
    give_up_when_denied: bool = False
    """Stop for good (`MqttTransport.failed`) at the first publication the broker denies (MQTT 5
    PUBACK "not authorized"): what a federation process wants, whose messages all go where its
    account must be allowed to write."""
    reconnect_min_delay: int = 1
    reconnect_max_delay: int = 30
    signing_key: bytes | None = None
    """The device's message-signing key (`signing.py`), from its credentials entry; None: unsigned."""

    def __post_init__(self) -> None:
        if self.protocol not in ("auto", *PROTOCOLS):
            raise ValueError(f"protocol must be auto, 5 or 3.1.1, got {self.protocol!r}")
        parsed = urlparse(self.url)
        if parsed.scheme not in ("mqtt", "mqtts", "tcp", "ssl") or not parsed.hostname:
            raise ValueError(f"broker url must look like mqtt://host:port or mqtts://host:port, got {self.url!r}")
        for name in ("ca_file", "cert_file", "key_file"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name} {path} does not exist")

    @property
    def host(self) -> str:
        return urlparse(self.url).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        parsed = urlparse(self.url)
        return parsed.port or (8883 if self.tls else 1883)

    @property
    def tls(self) -> bool:
        return urlparse(self.url).scheme in ("mqtts", "ssl") or self.ca_file is not None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def credentials_hint(self) -> str:
        """Where this account's credentials come from, for a refusal's message."""
        who = f"user {self.username!r}" if self.username is not None else "an anonymous client"
        return (f"{who}: check --username with --password, --password-file or EDGEPFL_PASSWORD, or "
                "--credentials (and the broker's ACL)")


class _Client(mqtt.Client):
    """paho's client, reading at most `READ_SIZE` bytes from the socket at a time, and writing a
    large packet from a view of it: paho slices what is left of the packet for every socket
    write, a copy each time (quadratic in the packet's size) where the packet is a bytearray."""

    def _sock_recv(self, bufsize: int) -> bytes:
        return super()._sock_recv(min(bufsize, READ_SIZE))

    def _packet_queue(self, command: int, packet: bytes | bytearray, mid: int, qos: int,
                      info: mqtt.MQTTMessageInfo | None = None) -> mqtt.MQTTErrorCode:
        if len(packet) > READ_SIZE and self._transport != "websockets":  # paho masks websocket frames in place
            packet = memoryview(packet).toreadonly()  # type: ignore[assignment]
        return super()._packet_queue(command, packet, mid, qos, info)


class MqttTransport:
    """One MQTT connection. `incoming` yields `Incoming(topic, payload)` for subscribed topics.

    `flow_control_bytes` (0: off) bounds what the consumer of `incoming` holds, in bytes: see
    `flow.IncomingQueue`. Leave it off where the consumer can be busy for longer than the
    keepalive allows (a device training), set it where memory matters (the coordinator).
    """

    def __init__(
        self,
        client_id: str,
        settings: MqttSettings,
        *,
        will: tuple[str, bytes] | None = None,
        counter: ByteCounter | None = None,
        max_queue: int = 10_000,
        flow_control_bytes: int = 0,
    ):
        self.client_id = client_id
        self.settings = settings
        self.counter = counter or ByteCounter()
        self.incoming = IncomingQueue(max_queue, flow_control_bytes, max_wait=settings.keepalive / 2)
        self.connected = threading.Event()
        self.dropped_incoming = 0
        self.connections = 0
        self.max_packet_size: int | None = None  # the broker's, from an MQTT 5 CONNACK
        self._will = will
        self._subscriptions: dict[str, int] = {}
        self._lock = threading.Lock()
        self._refused: TransportError | None = None
        self._client: mqtt.Client | None = None
        self.protocol: str | None = None
        self.failed = threading.Event()
        """Set once the broker will not have this client any more (see `failure`)."""
        self.failure: NotAuthorized | None = None
        self._connected_at = 0.0
        self._brief_connections = 0
        self._sent_topics: dict[int, str] = {}  # message id -> topic, for a PUBACK's refusal
        self._unacknowledged: deque[mqtt.MQTTMessageInfo] = deque(maxlen=MAX_TRACKED_PUBLICATIONS)
        self._subscribing: dict[int, str] = {}  # message id -> topic filter awaiting its SUBACK
        self._early_subacks: dict[int, list] = {}  # message id -> reason codes of a SUBACK read before its id
        self._subscribe_refusals: dict[str, int] = {}  # topic filter -> refusals in a row
        self.refused_subscriptions = 0
        """SUBACKs that refused a subscription (each one tried again, see the module docstring)."""
        self._unconfirmed: set[str] = set()  # topic filters this connection has no granting SUBACK for
        self._dropped = False  # `drop_connection` ended the connection; `reconnect` makes a new one
        self.dropped_offline = 0
        """Publications dropped while the connection was dropped (`drop_connection`)."""

    # -- lifecycle -------------------------------------------------------------------------
    def connect(self) -> None:
        """Connect (each attempt blocking up to `connect_timeout`), trying MQTT 5 then 3.1.1 under
        auto; while the broker is unreachable, retry with backoff for `retry_first_connect` s."""
        deadline = time.monotonic() + self.settings.retry_first_connect
        delay = 1.0
        while True:
            try:
                self._connect_once()
                return
            except BrokerUnreachable as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                log.warning("%s; retrying in %.0f s (for %.0f s more)", exc, min(delay, left), left)
                time.sleep(min(delay, left))
                delay = min(2 * delay, RETRY_MAX_DELAY)

    def _connect_once(self) -> None:
        candidates = list(PROTOCOLS) if self.settings.protocol == "auto" else [self.settings.protocol]
        for protocol in candidates:
            try:
                self._connect_with(protocol)
                return
            except (BrokerUnreachable, NotAuthorized):
                raise  # the same under either version
            except TransportError as exc:
                if protocol == candidates[-1]:
                    raise
                log.debug("%s: MQTT %s failed (%s); trying the next version", self.client_id, protocol, exc)

    def _connect_with(self, protocol: str) -> None:
        client = self._make_client(protocol)
        self._refused = None
        self.connected.clear()
        try:
            if PROTOCOLS[protocol] == mqtt.MQTTv5:
                props = Properties(PacketTypes.CONNECT)
                props.SessionExpiryInterval = 0
                client.connect(self.settings.host, self.settings.port, self.settings.keepalive, clean_start=True,
                               properties=props)
            else:
                client.connect(self.settings.host, self.settings.port, self.settings.keepalive)
        except (OSError, ValueError) as exc:
            raise self._connect_error(exc) from None
        client.loop_start()
        answered = self.connected.wait(self.settings.connect_timeout)
        if not answered or self._refused:
            client.loop_stop()
            client.disconnect()
            raise self._refused or TransportError(
                f"no CONNACK from {self.settings.address} within {self.settings.connect_timeout:.0f} s: is it an MQTT "
                f"broker{'' if self.settings.tls else ', and not a TLS port (then use mqtts://)'}?")
        self._client = client
        self.protocol = protocol

    def _connect_error(self, exc: BaseException) -> TransportError:
        """The one-line error of a failed TCP or TLS connection to the broker."""
        address = self.settings.address
        if self.settings.tls and isinstance(exc, (ConnectionResetError, ssl.SSLEOFError)):
            return TransportError(f"the broker at {address} closed the connection during the TLS handshake: is it a "
                                  "plain MQTT port? use mqtt://")
        if isinstance(exc, ssl.SSLError):
            return TransportError(f"TLS with {address} failed ({exc.reason or exc}): check --ca-file, --cert-file and "
                                  "--key-file, or use mqtt:// if the port does not speak TLS")
        if isinstance(exc, socket.gaierror):
            return BrokerUnreachable(f"cannot resolve the broker's host {self.settings.host!r} ({exc.strerror})")
        if isinstance(exc, ConnectionRefusedError):
            return BrokerUnreachable(f"nothing listens at {address} (connection refused): is the broker running, "
                                     "and is --broker its address?")
        if isinstance(exc, (TimeoutError, socket.timeout)) or getattr(exc, "errno", None) in (
                errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ECONNRESET):
            return BrokerUnreachable(f"cannot reach the broker at {address} ({exc}): is it up, and is --broker "
                                     "its address?")
        return TransportError(f"cannot connect to the broker at {address}: {exc}")

    def _make_client(self, protocol: str) -> mqtt.Client:
        version = PROTOCOLS[protocol]
        clean_session = True if version == mqtt.MQTTv311 else None  # MQTT 5 has clean_start instead
        client = _Client(CallbackAPIVersion.VERSION2, client_id=self.client_id, protocol=version,
                         clean_session=clean_session)
        client.max_inflight_messages_set(64)
        client.max_queued_messages_set(0)
        client.reconnect_delay_set(self.settings.reconnect_min_delay, self.settings.reconnect_max_delay)
        if self.settings.username is not None:
            client.username_pw_set(self.settings.username, self.settings.password)
        if self.settings.tls:
            client.tls_set(
                ca_certs=self.settings.ca_file,
                certfile=self.settings.cert_file,
                keyfile=self.settings.key_file,
                cert_reqs=ssl.CERT_REQUIRED,
                tls_version=ssl.PROTOCOL_TLS_CLIENT,
            )
        if self._will is not None:
            client.will_set(self._will[0], self._will[1], qos=1, retain=False)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        client.on_subscribe = self._on_subscribe
        return client

    def close(self) -> None:
        """Disconnect cleanly (the broker does not send the Last Will on a clean disconnect),
        once the broker acknowledged what was published at QoS 1 (up to `FLUSH_SECONDS`)."""
        self._flush()
        client, self._client = self._client, None
        self.incoming.close()
        if client is not None:
            client.disconnect()
            with contextlib.suppress(AttributeError):  # paho 2.2: the network thread may clear itself first
                client.loop_stop()
        self.connected.clear()

    def drop_connection(self) -> None:
        """End the connection without a DISCONNECT, as a device that loses its network: the broker
        publishes the Last Will. No reconnection follows until `reconnect`; publications until
        then are dropped. For simulated availability: a real device loses its network by itself."""
        client, self._client = self._client, None
        self._dropped = True
        self.connected.clear()
        if client is None:
            return
        client.loop_stop()  # first: paho's network thread would reconnect at once
        sock = client.socket()
        if isinstance(sock, socket.socket):  # ssl.SSLSocket too
            with contextlib.suppress(OSError):  # the broker may have closed it already
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def reconnect(self) -> None:
        """A new connection after `drop_connection`: a new session (clean), the subscriptions
        made again and `connections` counted up, as after any reconnection."""
        if not self._dropped:
            return
        self._connect_once()
        self._dropped = False

    def _flush(self) -> None:
        """Wait, while connected, until the broker acknowledged every QoS 1 publication still in flight."""
        deadline = time.monotonic() + FLUSH_SECONDS
        while self._unacknowledged and self.connected.is_set() and self.failure is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.warning("%s: %d publications not acknowledged by the broker within %.0f s of closing",
                            self.client_id, len(self._unacknowledged), FLUSH_SECONDS)
                return
            oldest = self._unacknowledged[0]
            if not _settled(oldest):
                oldest.wait_for_publish(remaining)
            if _settled(oldest) or time.monotonic() >= deadline:
                self._unacknowledged.popleft()

    # -- operations ------------------------------------------------------------------------
    def subscriptions_active(self) -> bool:
        """Connected, and the broker granted every subscription on this connection: what is
        published from now on reaches this client (what a re-publication after a reconnection waits for)."""
        with self._lock:
            return self.connected.is_set() and not self._unconfirmed

    def subscribe(self, topic_filter: str, qos: int = 1) -> None:
        with self._lock:
            self._subscriptions[topic_filter] = qos
            self._unconfirmed.add(topic_filter)
        if self._client is not None and self.connected.is_set():
            self._subscribe(self._client, topic_filter, qos)

    def _subscribe(self, client: mqtt.Client, topic_filter: str, qos: int) -> None:
        """Send SUBSCRIBE, remembering its message id for the SUBACK (which may come first: paho's
        network thread can read it before `subscribe` returns; never hold `_lock` across paho calls,
        whose callbacks take it)."""
        result, mid = client.subscribe(topic_filter, qos)
        if result != mqtt.MQTT_ERR_SUCCESS or mid is None:
            return
        with self._lock:
            early = self._early_subacks.pop(mid, None)
            if early is None:
                self._subscribing[mid] = topic_filter
        if early is not None:
            self._check_suback(client, topic_filter, early)

    def publish(self, topic: str, payload: bytes | bytearray | memoryview, *, qos: int = 1,
                retain: bool = False) -> None:
        client = self._client
        if client is None and not self._dropped:
            raise TransportError("publish before connect")
        if not isinstance(payload, (bytes, bytearray)):
            payload = bytes(payload)  # paho takes bytes or bytearray only
        if self.failure is not None:
            raise self.failure
        info = client.publish(topic, payload, qos=qos, retain=retain) if client is not None else None
        if info is None or self._dropped:  # a connection dropped before, or while, publishing
            self.dropped_offline += 1
            return
        if qos and self.settings.give_up_when_denied:
            self._sent_topics[info.mid] = topic  # for the message of a denial
        if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
            raise TransportError(f"publish to {topic} failed: {mqtt.error_string(info.rc)}")
        if qos:
            while self._unacknowledged and _settled(self._unacknowledged[0]):
                self._unacknowledged.popleft()
            self._unacknowledged.append(info)
        self.counter.record("sent", topic, len(payload))

    # -- paho callbacks (network thread: never raise; only flow control waits) ---------------
    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            self._refused = self._refusal(reason_code)
            self.connected.set()
            return
        self.connections += 1
        self._connected_at = time.monotonic()
        self.max_packet_size = getattr(properties, "MaximumPacketSize", None)
        with self._lock:
            subscriptions = list(self._subscriptions.items())
            self._unconfirmed = set(self._subscriptions)
        for topic_filter, qos in subscriptions:
            self._subscribe(client, topic_filter, qos)
        if self.connections > 1:
            log.info("%s reconnected to %s (connection %d)", self.client_id, self.settings.url, self.connections)
        self.connected.set()

    def _refusal(self, reason_code) -> TransportError:
        """The error of a CONNACK that refused the connection."""
        name = reason_code.getName()
        if name in REFUSALS:
            return NotAuthorized(f"the broker at {self.settings.address} refused {self.client_id!r}: {REFUSALS[name]} "
                                 f"for {self.settings.credentials_hint()}")
        return TransportError(f"the broker at {self.settings.address} refused the connection: {name}")

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        if self._client is None and not self.connected.is_set():
            hint = ("check the client certificate and --ca-file" if self.settings.tls
                    else "is it a TLS port? use mqtts://")
            self._refused = TransportError(f"the broker at {self.settings.address} closed the connection before "
                                           f"CONNACK: {hint}")
            self.connected.set()  # wake connect(): this attempt failed
            return
        self.connected.clear()
        if self._client is None:
            return
        brief = time.monotonic() - self._connected_at < BRIEF_CONNECTION
        self._brief_connections = self._brief_connections + 1 if brief else 0
        if self.failure is None and self._brief_connections >= BRIEF_CONNECTIONS_IN_A_ROW:
            self._give_up(client, NotAuthorized(
                f"the broker at {self.settings.address} closed {self.client_id!r}'s connection right after accepting "
                f"it {self._brief_connections} times in a row: most often its ACL denies this device's topics; "
                f"{self.settings.credentials_hint()}, and that the account is this device's"))
        if self.failure is not None:
            return
        log.warning("%s lost the broker connection: %s; reconnecting", self.client_id, reason_code)

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
        topic = self._sent_topics.pop(mid, "?")
        denied = reason_code.getName() == "Not authorized"
        if denied and self.settings.give_up_when_denied and self.failure is None:
            self._give_up(client, NotAuthorized(
                f"the broker at {self.settings.address} denied {self.client_id!r} publishing to {topic}: its ACL does "
                f"not allow this account there; {self.settings.credentials_hint()}, and that the account is this "
                "device's"))

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        with self._lock:
            topic_filter = self._subscribing.pop(mid, None)
            if topic_filter is None:
                self._early_subacks[mid] = list(reason_codes)
                return
        self._check_suback(client, topic_filter, reason_codes)

    def _check_suback(self, client, topic_filter: str, reason_codes) -> None:
        """A SUBACK's verdict on `topic_filter`: granted, refused (retried later) or denied for good."""
        refusal = next((code for code in reason_codes if code.is_failure), None)
        if refusal is None:
            with self._lock:
                self._unconfirmed.discard(topic_filter)
            self._subscribe_refusals.pop(topic_filter, None)
            return
        self.refused_subscriptions += 1
        if refusal.getName() == "Not authorized" and self.settings.give_up_when_denied and self.failure is None:
            self._give_up(client, NotAuthorized(
                f"the broker at {self.settings.address} denied {self.client_id!r} subscribing to {topic_filter}: its "
                f"ACL does not allow this account there; {self.settings.credentials_hint()}"))
            return
        refusals = self._subscribe_refusals[topic_filter] = self._subscribe_refusals.get(topic_filter, 0) + 1
        delay = min(2.0 ** (refusals - 1), RETRY_MAX_DELAY)
        log.warning("%s: the broker at %s refused the subscription to %s (%s); trying again in %.0f s", self.client_id,
                    self.settings.address, topic_filter, refusal.getName(), delay)
        retry = threading.Timer(delay, self._subscribe_again, (client, topic_filter))
        retry.daemon = True
        retry.start()

    def _subscribe_again(self, client: mqtt.Client, topic_filter: str) -> None:
        """A refused subscription's retry; a connection lost meanwhile subscribes again by itself."""
        with self._lock:
            qos = self._subscriptions.get(topic_filter)
        if qos is not None and client is self._client and self.connected.is_set() and self.failure is None:
            self._subscribe(client, topic_filter, qos)

    def _give_up(self, client, failure: NotAuthorized) -> None:
        """The broker will not have this client: record why, stop reconnecting, wake the owner."""
        self.failure = failure
        log.error("%s", failure)
        client.disconnect()  # from the network thread: paho's loop ends instead of reconnecting
        self.failed.set()

    def _on_message(self, client, userdata, message) -> None:
        try:
            self.counter.record("received", message.topic, len(message.payload))
            self.incoming.put_message(Incoming(message.topic, message.payload))
        except queue.Full:
            self.dropped_incoming += 1
        except Exception:  # a callback must never raise into paho's network loop
            log.exception("dropping a message on %s", getattr(message, "topic", "?"))
