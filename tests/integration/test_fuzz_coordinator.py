"""A live coordinator under a flood of mutated, random, oversized and chunked messages (Mosquitto).

The coordinator runs in a thread with two real EdgeClients registered; while it waits for the
third, an attacker connection publishes more than 10 000 mutated messages to every upstream
topic kind of the registered ids, of unknown ids and of ids that are not valid client ids. The
coordinator must survive, count the rejections, register nobody, apply no round, stay bounded
in memory, and then run the round normally once the third real device arrives.

Why no fuzz message can be a legitimate registration or Last Will: the channel only accepts an
upstream message whose envelope `sender` equals the topic's client id. Every HELLO and OFFLINE
the fuzzer starts from names a sender that is *longer* than the topic id ("<id>-impostor"), so
an in-place mutation (which keeps msgpack's string length header) cannot make the two equal; a
mutation that alters the length header desynchronizes the rest of the map. The only HELLOs whose
sender matches the topic are sent unmutated and are invalid by content (a topic id that is not a
valid client id, or a bad device type / example count). As a belt-and-braces check, every
mutated HELLO/OFFLINE is decoded before sending and dropped if it has become a well-formed
message from the topic's own valid id; the count of such drops is reported (expected 0).
"""

from __future__ import annotations

import logging
import math
import os
import random
import struct
import threading
import time
from collections import Counter
from typing import Any

import msgpack
import numpy as np
import psutil
import pytest

from coordinator.config.run_config import RunConfig
from coordinator.events import RegistrationOpened
from coordinator.server import Coordinator
from edge_sdk import wire
from test_doubles import CoordinatorThread
from edge_sdk.channel import Channel
from edge_sdk.chunks import MIN_CHUNK_SIZE, chunk_frames
from edge_sdk.client import EdgeClient
from edge_sdk.counters import ByteCounter
from edge_sdk.data import load_client_data
from edge_sdk.protocol import Envelope, Kind, ProtocolError, Topics, check_client_id
from edge_sdk.transport import MqttSettings, MqttTransport

pytestmark = pytest.mark.integration

FEDERATION = "fuzzfed"
TOPICS = Topics(FEDERATION)
REGISTERED = ("dev0", "dev1")
UNKNOWN = tuple(f"ghost-{i:02d}" for i in range(6))
INVALID_IDS = ("coordinator", "all", "x" * 65, "white space", "ünïcode")
UP = (Kind.HELLO, Kind.OFFLINE, Kind.TRAIN_RES, Kind.EVAL_RES)
MUTATED = 10_000
WINDOW = 1_500  # messages in flight between the attacker and the coordinator's loop


class MessageCounter(ByteCounter):
    """Also counts received messages, so the attacker can pace itself to the coordinator."""

    def __init__(self) -> None:
        super().__init__()
        self.received_messages = 0

    def record(self, direction: str, topic: str, payload_len: int) -> None:
        super().record(direction, topic, payload_len)
        if direction == "received":
            self.received_messages += 1  # only paho's network thread writes


class MarkerWatcher(logging.Handler):
    """Sets `seen` when the channel logs a rejection that names `marker` (the last message sent)."""

    def __init__(self, marker: str):
        super().__init__(logging.WARNING)
        self.marker = marker
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.marker in record.getMessage():
            self.seen.set()


def wait_until(condition, timeout: float, what: str) -> None:
    deadline, pause = time.monotonic() + timeout, threading.Event()
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        pause.wait(0.05)


def start_coordinator(url: str, out, *, clients: int, finish: threading.Event | None = None,
                      registering: threading.Event | None = None):
    """A coordinator thread waiting for `clients` devices; `registering` is set once it has
    subscribed to the devices' topics (a message published before that reaches nobody)."""
    config = RunConfig.of(algorithm="fedavg", dataset="digits", clients=clients, rounds=1, out=str(out),
                          federation=FEDERATION, round_timeout=30, registration_timeout=120, local_epochs=1,
                          min_clients=clients)
    counter = MessageCounter()
    transport = MqttTransport(f"{FEDERATION}.coordinator", MqttSettings(url=url), counter=counter)
    transport.connect()
    # `finish` fast-forwards the coordinator's clock, ending its registration wait at once
    clock = (lambda: time.monotonic() + (1e6 if finish.is_set() else 0.0)) if finish else time.monotonic
    coordinator = Coordinator(config, Channel(transport, TOPICS, chunk_size=config.broker.chunk_size), clock=clock)
    if registering is not None:
        coordinator.subscribe(lambda event: registering.set(), RegistrationOpened)
    thread = CoordinatorThread(coordinator)
    thread.start()
    return coordinator, thread, transport, counter


def start_device(url: str, index: int, out, stop: threading.Event) -> tuple[EdgeClient, threading.Thread]:
    data = load_client_data("digits", num_clients=3, index=index, seed=0)
    client = EdgeClient(f"dev{index}", data, broker=MqttSettings(url=url), federation=FEDERATION,
                        state_dir=out / f"dev{index}")
    thread = threading.Thread(target=client.run, args=(stop,), daemon=True, name=f"dev{index}")
    thread.start()
    return client, thread


# -- the fuzz corpus -------------------------------------------------------------------------


def mutate(rng: random.Random, data: bytes, splice_from: list[bytes]) -> bytes:
    """Bit flips, truncation, insertion, deletion, header-byte overwrites and splices."""
    buffer = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        op = rng.choice(("flip", "flip", "truncate", "insert", "delete", "overwrite", "splice"))
        pos = rng.randrange(len(buffer)) if buffer else 0
        if op == "flip" and buffer:
            buffer[pos] ^= 1 << rng.randrange(8)
        elif op == "truncate":
            del buffer[pos:]
        elif op == "insert":
            buffer[pos:pos] = rng.randbytes(rng.randint(1, 16))
        elif op == "delete":
            del buffer[pos:pos + rng.randint(1, 16)]
        elif op == "overwrite" and buffer:
            buffer[pos] = rng.choice((0x00, 0x80, 0x90, 0xA0, 0xC0, 0xC1, 0xC6, 0xCB, 0xD9, 0xDB, 0xDD, 0xDF, 0xFF))
        elif op == "splice":
            other = rng.choice(splice_from)
            buffer[pos:] = other[rng.randrange(len(other) + 1):]
    return bytes(buffer)


class Corpus:
    """Seeded generator of (topic, payload, label) triples built from valid envelopes."""

    def __init__(self, rng: random.Random, run_id: str, spec: dict):
        self.rng = rng
        self.run_id = run_id
        self.spec = spec
        self.legit_dropped = 0
        ids = REGISTERED + UNKNOWN + INVALID_IDS
        self.topic_ids = ids
        self.bases: dict[tuple[str, Kind], list[bytes]] = {}
        for client_id in ids:
            self.bases[(client_id, Kind.HELLO)] = [self._hello(f"{client_id}-impostor")]
            self.bases[(client_id, Kind.OFFLINE)] = [wire.encode(Envelope(Kind.OFFLINE, f"{client_id}-impostor"))]
            self.bases[(client_id, Kind.TRAIN_RES)] = [self._train_res(client_id, shapes) for shapes in
                                                       ("wrong", "missing", "dtype")]
            self.bases[(client_id, Kind.EVAL_RES)] = [self._eval_res(client_id, run) for run in
                                                      (run_id, "not-this-run")]
        for client_id in INVALID_IDS:  # the sender owns the topic, but the id is not a valid client id
            self.bases[(client_id, Kind.HELLO)].append(self._hello(client_id))
        self.big = {client_id: self._train_res(client_id, "right") for client_id in REGISTERED + UNKNOWN[:2]}
        self.all_bases = [b for bases in self.bases.values() for b in bases]

    # valid envelopes ------------------------------------------------------------------------
    def _hello(self, sender: str, **metrics) -> bytes:
        return wire.encode(Envelope(Kind.HELLO, sender, metrics=metrics or {"num_examples": 100, "num_test": 20},
                                    config={"device_type": "trainer", "algorithms": ["fedavg"]}))

    def _arrays(self, shapes: str) -> dict:
        arrays = {name: np.zeros(shape, dtype=dtype) for name, (shape, dtype) in self.spec["shared"].items()}
        if shapes == "wrong":
            arrays = {name: np.zeros((2,) + tuple(a.shape[1:])[:1], np.float32) for name, a in arrays.items()}
        elif shapes == "missing":
            arrays = dict(list(arrays.items())[:1]) | {"extra.weight": np.ones(3, np.float32)}
        elif shapes == "dtype":
            arrays = {name: np.zeros(min(a.size, 8), np.float64) for name, a in arrays.items()}
        return {"shared": arrays}

    def _train_res(self, sender: str, shapes: str) -> bytes:
        return wire.encode(Envelope(Kind.TRAIN_RES, sender, run_id=self.run_id, round=1, groups=self._arrays(shapes),
                                    metrics={"num_examples": 100, "loss": 0.5}))

    def _eval_res(self, sender: str, run_id: str) -> bytes:
        return wire.encode(Envelope(Kind.EVAL_RES, sender, run_id=run_id, round=1, metrics={"accuracy": 0.5}))

    # the messages ---------------------------------------------------------------------------
    def _is_legitimate(self, client_id: str, kind: Kind, payload: bytes) -> bool:
        """A well-formed HELLO/OFFLINE from the topic's own valid id: a real registration/Last Will."""
        if kind not in (Kind.HELLO, Kind.OFFLINE):
            return False
        try:
            check_client_id(client_id)
            envelope = wire.decode(payload)
        except (ValueError, ProtocolError):
            return False
        return envelope.sender == client_id and envelope.kind is kind

    def mutated(self) -> tuple[str, bytes, str]:
        while True:
            client_id, kind = self.rng.choice(self.topic_ids), self.rng.choice(UP)
            if kind is Kind.TRAIN_RES and client_id in self.big and self.rng.random() < 0.004:
                base = self.big[client_id]  # a right-shaped 600 kB update, a few dozen times in all
            else:
                base = self.rng.choice(self.bases[(client_id, kind)] + [self.rng.choice(self.all_bases)])
            payload = mutate(self.rng, base, self.all_bases)
            if not payload:
                continue
            if self._is_legitimate(client_id, kind, payload):
                self.legit_dropped += 1
                continue
            return TOPICS.up(client_id, kind), payload, "mutated"

    def random_bytes(self) -> tuple[str, bytes, str]:
        client_id, kind = self.rng.choice(self.topic_ids), self.rng.choice(UP)
        return TOPICS.up(client_id, kind), self.rng.randbytes(self.rng.randint(1, 2048)), "random"

    def invalid_hellos(self) -> list[tuple[str, bytes, str]]:
        """Unmutated HELLOs whose sender owns the (unknown, valid) topic id but whose content is invalid."""
        out = []
        hellos: list[tuple[dict[str, float], dict[str, Any]]] = [
            ({"num_examples": 0}, {"device_type": "trainer"}),
            ({"num_examples": -5}, {"device_type": "trainer"}),
            ({"num_examples": 0.5}, {"device_type": "trainer"}),
            ({"num_test": 10}, {"device_type": "trainer"}),  # no example count at all
            ({"num_examples": 100}, {"device_type": "server"}),
            ({"num_examples": 100}, {"device_type": None}),
            ({"num_examples": 100}, {"device_type": ["trainer"]}),
            ({"num_examples": 100}, {"device_type": ""}),
        ]
        for index, (metrics, config) in enumerate(hellos):
            client_id = UNKNOWN[index % len(UNKNOWN)]
            payload = wire.encode(Envelope(Kind.HELLO, client_id, metrics=metrics, config=config))
            out.append((TOPICS.up(client_id, Kind.HELLO), payload, "invalid-hello"))
        return out

    def oversized(self) -> list[tuple[str, bytes, str]]:
        rng, out = self.rng, []
        hello = wire.envelope_to_dict(Envelope(Kind.HELLO, "ghost-00"))
        documents = [
            rng.randbytes(4 << 20),
            rng.randbytes(4 << 20),
            msgpack.packb({**hello, "config": {"s": "x" * 100_000}}),  # a str above max_string
            msgpack.packb({**hello, "config": {"l": [None] * 1_100_000}}),  # a list above max_items
            msgpack.packb({**hello, "groups": {"g": {f"a{i}": wire.encode_array(np.zeros(0, np.uint8))
                                                     for i in range(70_000)}}}, use_bin_type=True),  # max_arrays
            b"\xc6\xff\xff\xff\xff" + rng.randbytes(64),  # a bin claiming 4 GiB
            b"\xdd\xff\xff\xff\xff" + rng.randbytes(64),  # an array claiming 4 Gi items
            b"\xdf\xff\xff\xff\xff" + rng.randbytes(64),  # a map claiming 4 Gi entries
            b"\xdd" + struct.pack(">I", 1 << 20) + b"\xc0" * 64,  # 1 Mi items declared, 64 present
        ]
        for document in documents:
            client_id, kind = rng.choice(self.topic_ids), rng.choice(UP)
            out.append((TOPICS.up(client_id, kind), document, "oversized"))
        return out

    def chunk_frames(self) -> list[tuple[str, bytes, str]]:
        """Incomplete blobs (held until dropped), corrupted complete ones and bad manifests."""
        rng, out = self.rng, []
        for index in range(4):  # big incomplete blobs: every frame but one of a right-shaped update
            client_id = REGISTERED[index % 2]
            frames = chunk_frames(self._train_res(client_id, "right"), MIN_CHUNK_SIZE)
            del frames[rng.randrange(len(frames))]
            out += [(TOPICS.up(client_id, Kind.TRAIN_RES), f, "chunk-incomplete") for f in frames]
        for _ in range(100):  # many small incomplete blobs: more than the 64 the reassembler keeps
            client_id, kind = rng.choice(REGISTERED + UNKNOWN), rng.choice(UP)
            frames = chunk_frames(rng.randbytes(MIN_CHUNK_SIZE + 100), MIN_CHUNK_SIZE)
            out.append((TOPICS.up(client_id, kind), frames[rng.randrange(2)], "chunk-incomplete"))
        for _ in range(4):  # complete blobs with one corrupted byte: checksum failure
            client_id = rng.choice(REGISTERED)
            payload = self._train_res(client_id, "wrong") + rng.randbytes(MIN_CHUNK_SIZE)
            damaged = [bytearray(f) for f in chunk_frames(payload, MIN_CHUNK_SIZE)]
            damaged[-1][-1] ^= 0xFF
            out += [(TOPICS.up(client_id, Kind.TRAIN_RES), bytes(f), "chunk-corrupt") for f in damaged]
        for _ in range(10):  # inconsistent manifests and blobs declaring more than 512 MiB
            client_id = rng.choice(REGISTERED + UNKNOWN)
            frames = chunk_frames(rng.randbytes(2 * MIN_CHUNK_SIZE + 7), MIN_CHUNK_SIZE)
            first = msgpack.unpackb(frames[0])
            liar = msgpack.unpackb(frames[1])
            liar["chunk"]["size"] += 1
            huge = msgpack.unpackb(frames[2])
            huge["chunk"]["size"] = 1 << 40
            huge["chunk"]["count"] = (1 << 40) // MIN_CHUNK_SIZE
            topic = TOPICS.up(client_id, Kind.TRAIN_RES)
            out += [(topic, msgpack.packb(first), "chunk-incomplete"),
                    (topic, msgpack.packb(liar), "chunk-manifest"),
                    (topic, msgpack.packb(huge), "chunk-huge")]
        return out


# -- the tests -------------------------------------------------------------------------------


def test_coordinator_survives_a_fuzz_flood_then_completes_the_round(mosquitto, tmp_path):
    # Prepare: a coordinator waiting for 3 devices, 2 of them registered
    started = time.monotonic()
    stop = threading.Event()
    coordinator, thread, transport, counter = start_coordinator(mosquitto.url, tmp_path / "run", clients=3)
    devices = [start_device(mosquitto.url, index, tmp_path, stop) for index in range(2)]
    wait_until(lambda: set(coordinator.registry.devices) == set(REGISTERED), 60, "dev0 and dev1 to register")
    corpus = Corpus(random.Random(20240607), coordinator.run_id, coordinator.algorithm.update_spec(1))
    messages = [corpus.mutated() for _ in range(MUTATED)]
    messages += [corpus.random_bytes() for _ in range(1_000)]
    messages += corpus.invalid_hellos() + corpus.oversized() + corpus.chunk_frames()
    random.Random(7).shuffle(messages)
    marker = "zz-end-of-fuzz"
    watcher = MarkerWatcher(marker)
    logging.getLogger("edge_sdk.channel").addHandler(watcher)
    attacker = MqttTransport(f"{FEDERATION}.attacker", MqttSettings(url=mosquitto.url))
    attacker.connect()
    rejections0, duplicates0 = Counter(coordinator.channel.rejections), coordinator.channel.duplicates
    received0 = counter.received_messages
    process = psutil.Process(os.getpid())
    rss0 = process.memory_info().rss
    fuzz_started = time.monotonic()

    # Execute: publish everything, paced so that neither paho's queue nor Mosquitto drops messages
    try:
        for sent, (topic, payload, _) in enumerate(messages, 1):
            attacker.publish(topic, payload, qos=0)
            if sent % 250 == 0:
                wait_until(lambda sent=sent: counter.received_messages - received0 >= sent - WINDOW
                           and transport.incoming.qsize() < WINDOW, 60, "the coordinator to keep up")
        attacker.publish(TOPICS.up(marker, Kind.HELLO), b"\xc1", qos=0)  # never valid msgpack
        wait_until(lambda: watcher.seen.is_set() or not thread.is_alive(), 120, "the end-of-fuzz marker")
    finally:
        logging.getLogger("edge_sdk.channel").removeHandler(watcher)
        attacker.close()
    fuzz_seconds = time.monotonic() - fuzz_started
    rss1 = process.memory_info().rss
    rejections = Counter(coordinator.channel.rejections)
    rejections.subtract(rejections0)
    rejections = +rejections
    duplicates = coordinator.channel.duplicates - duplicates0
    labels = Counter(label for _, _, label in messages)
    dropped = transport.dropped_incoming
    delivered = counter.received_messages - received0 - 1
    print(f"\nfuzz: sent {len(messages)} messages {dict(labels)} in {fuzz_seconds:.1f} s; delivered {delivered}; "
          f"paho-queue drops {dropped}; legit mutations dropped {corpus.legit_dropped}")
    print(f"fuzz: rejections {sum(rejections.values())} {dict(rejections)}; duplicates {duplicates}; "
          f"RSS {rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MiB")

    # Assert: alive, nothing registered or applied, rejections counted, memory bounded
    assert thread.is_alive() and thread.error is None, f"coordinator died: {thread.error!r}"
    assert coordinator.completed == 0
    assert not coordinator.folder.checkpoint.exists()
    assert set(coordinator.registry.devices) == set(REGISTERED)
    assert coordinator.registry.online("trainer") == list(REGISTERED)
    not_counted_at_arrival = labels["chunk-incomplete"]  # held for reassembly, dropped later
    assert sum(rejections.values()) + duplicates >= 0.95 * (len(messages) - not_counted_at_arrival)
    assert sum(rejections.values()) >= 0.9 * len(messages)
    assert rejections["chunk_overflow"] >= 1 and rejections["chunk_checksum"] >= 1
    assert rss1 - rss0 < 400 * 2**20

    # Execute: the third real device joins
    devices.append(start_device(mosquitto.url, 2, tmp_path, stop))
    thread.join(timeout=120)
    stop.set()
    transport.close()
    for _, device_thread in devices:
        device_thread.join(timeout=30)

    # Assert: the round ran normally with all three
    assert thread.error is None, f"coordinator failed: {thread.error!r}"
    report = thread.report
    print(f"fuzz: rounds_completed {report['rounds_completed']}, participants "
          f"{[r['participants'] for r in report['rounds']]}; total {time.monotonic() - started:.1f} s")
    assert report["rounds_completed"] == 1
    assert [r["participants"] for r in report["rounds"]] == [3]
    assert set(report["final"]["per_client"]) == {"dev0", "dev1", "dev2"}
    assert coordinator.folder.checkpoint.exists()


POISON = {
    "hello with a NaN example count": lambda: wire.encode(
        Envelope(Kind.HELLO, "ghost-00", metrics={"num_examples": math.nan}, config={"device_type": "trainer"})),
    "hello with an infinite example count": lambda: wire.encode(
        Envelope(Kind.HELLO, "ghost-00", metrics={"num_examples": math.inf}, config={"device_type": "trainer"})),
    "an array of zero size whose dimensions overflow numpy": lambda: msgpack.packb(
        {**wire.envelope_to_dict(Envelope(Kind.HELLO, "ghost-00")),
         "groups": {"g": {"a": {"dtype": "float64", "shape": [0, 2**40, 2**40], "data": b""}}}}),
}


@pytest.mark.parametrize("name", sorted(POISON))
def test_one_crafted_message_does_not_stop_the_coordinator(mosquitto, tmp_path, name):
    # Prepare: a coordinator waiting for its only device
    finish, registering = threading.Event(), threading.Event()
    coordinator, thread, transport, _ = start_coordinator(mosquitto.url, tmp_path / "run", clients=1, finish=finish,
                                                          registering=registering)
    wait_until(lambda: registering.is_set() and transport.subscriptions_active(), 60, "the coordinator's subscription")
    marker = "zz-after-poison"
    watcher = MarkerWatcher(marker)
    logging.getLogger("edge_sdk.channel").addHandler(watcher)
    attacker = MqttTransport(f"{FEDERATION}.attacker", MqttSettings(url=mosquitto.url))
    attacker.connect()
    try:
        # Execute: the poison, on the topic its sender owns, then a marker that is always rejected
        attacker.publish(TOPICS.up("ghost-00", Kind.HELLO), POISON[name](), qos=1)
        attacker.publish(TOPICS.up(marker, Kind.HELLO), b"\xc1", qos=1)
        wait_until(lambda: watcher.seen.is_set() or not thread.is_alive(), 60, "the marker")
        alive, error = thread.is_alive(), thread.error

        # Assert
        assert alive and error is None, f"coordinator died on {name}: {error!r}"
        assert "ghost-00" not in coordinator.registry.devices
        assert sum(coordinator.channel.rejections.values()) >= 2
    finally:
        logging.getLogger("edge_sdk.channel").removeHandler(watcher)
        attacker.close()
        finish.set()  # the registration wait ends (RegistrationTimeout) and the thread exits
        thread.join(timeout=30)
        transport.close()
