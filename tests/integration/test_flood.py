"""A 3-device FedAvg run over an anonymous Mosquitto while a flooder publishes junk (issue 22, item 17).

The federation uses a credentials file (as `edgepfl broker-config` writes one), so every device
signs its uploads; the broker itself checks nobody (anonymous, any username). While the run
lasts, a flooder on a connection of its own publishes, cycle after cycle: 8 MB of random bytes
on a `hello` topic, random bytes on every upstream topic kind of the devices and of unknown ids,
mutated copies of the devices' real uploads (it reads them: the broker lets it), exact replays
of them on their own and on other devices' topics, and forged updates for the open round that
name a device as sender (unsigned, and sealed with a wrong key) with zero arrays and a huge
example count, which would wipe out the model if one were aggregated. Bounded: at most
`CYCLES` cycles, and never more than `BACKLOG` bytes ahead of what the coordinator has read.

Asserted: every round aggregates the 3 devices' own updates (the final accuracy shows that no
forged update was averaged in), and the junk is rejected and counted by reason.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter, defaultdict

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.subscribeoptions import SubscribeOptions

from harness.brokers import Mosquitto
from coordinator.brokers.mosquitto import QUEUE_SETTINGS
from coordinator.config.run_config import RunConfig
from coordinator.events import RoundAggregated, RoundStarted, UpdateAccepted
from coordinator.server import Coordinator
from edge_sdk import wire
from edge_sdk.client import EdgeClient
from edge_sdk.data import load_client_data
from edge_sdk.protocol import Envelope, Kind, Topics
from edge_sdk.signing import SEALED_PREFIX, Signer, new_key
from test_doubles import CoordinatorThread

pytestmark = pytest.mark.integration

FEDERATION = "floodfed"
TOPICS = Topics(FEDERATION)
DEVICES = ("dev0", "dev1", "dev2")
GHOSTS = tuple(f"ghost{i}" for i in range(4))
ROUNDS = 10
CYCLES = 400
HELLO_JUNK = 8 << 20
BACKLOG = 64 << 20  # the most the flooder runs ahead of what the coordinator has read


class Flooder(threading.Thread):
    """Publishes the junk of the module docstring until `stop`, reading the real uploads to
    mutate and replay them (MQTT 5 no-local: it does not read its own)."""

    def __init__(self, url_port: int, coordinator: Coordinator, received_bytes, stop: threading.Event):
        super().__init__(daemon=True, name="flooder")
        self.rng = random.Random(22)
        self.coordinator, self.received_bytes, self.stop = coordinator, received_bytes, stop
        self.round = 0
        self.captured: dict[str, list[bytes]] = defaultdict(list)
        self.sent: Counter[str] = Counter()
        self.sent_bytes = 0
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="flooder", protocol=mqtt.MQTTv5)
        self.client.on_message = self._capture
        self.client.connect("127.0.0.1", url_port)
        self.client.loop_start()
        self.client.subscribe(f"{TOPICS.prefix}/up/+/{Kind.TRAIN_RES.value}", options=SubscribeOptions(qos=1,
                                                                                                     noLocal=True))
        shared = coordinator.algorithm.update_spec(1)["shared"]
        self.zeros = {name: np.zeros(shape, dtype=dtype) for name, (shape, dtype) in shared.items()}

    def _capture(self, client, userdata, message) -> None:
        if bytes(message.payload[:len(SEALED_PREFIX)]) == SEALED_PREFIX:
            self.captured[message.topic.split("/")[3]].append(bytes(message.payload))

    def _publish(self, label: str, device: str, kind: Kind, payload: bytes):
        self.sent[label] += 1
        self.sent_bytes += len(payload)
        return self.client.publish(TOPICS.up(device, kind), payload, qos=1)

    def _forged(self, device: str) -> bytes:
        envelope = Envelope(Kind.TRAIN_RES, device, run_id=self.coordinator.run_id, round=self.round,
                            groups={"shared": self.zeros}, metrics={"num_examples": 1_000_000})
        pieces = wire.encode_pieces(envelope)
        if self.rng.random() < 0.5:
            return b"".join(pieces)
        return b"".join(Signer(bytes(32)).seal(pieces))

    def _mutated(self, upload: bytes) -> bytes:
        data = bytearray(upload)
        for _ in range(self.rng.randint(1, 3)):
            data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
        return bytes(data)

    def cycle(self) -> None:
        rng = self.rng
        ids = DEVICES + GHOSTS
        info = self._publish("hello-8MB", rng.choice(ids), Kind.HELLO, rng.randbytes(HELLO_JUNK))
        for _ in range(30):
            kind = rng.choice((Kind.HELLO, Kind.OFFLINE, Kind.TRAIN_RES, Kind.EVAL_RES, Kind.FETCH))
            self._publish("random", rng.choice(ids), kind, rng.randbytes(rng.randint(1, 2048)))
        for device in DEVICES:
            if self.round:
                self._publish("forged-sender", device, Kind.TRAIN_RES, self._forged(device))
                other = rng.choice([d for d in DEVICES if d != device])
                self._publish("forged-sender", device, Kind.TRAIN_RES, self._forged(other))
            uploads = self.captured.get(device)
            if not uploads:
                continue
            for _ in range(3):
                self._publish("mutated", device, Kind.TRAIN_RES, self._mutated(rng.choice(uploads)))
            self._publish("replayed", device, Kind.TRAIN_RES, rng.choice(uploads))
            self._publish("replayed", rng.choice(DEVICES), Kind.TRAIN_RES, rng.choice(uploads))
        info.wait_for_publish(30)

    def run(self) -> None:
        try:
            for _ in range(CYCLES):
                while self.sent_bytes - self.received_bytes() > BACKLOG and not self.stop.is_set():
                    self.stop.wait(0.01)
                if self.stop.is_set():
                    return
                self.cycle()
        finally:
            self.client.disconnect()
            self.client.loop_stop()


def credentials(path) -> str:
    """A credentials.json as `edgepfl broker-config` writes it (the broker checks no password here)."""
    document = {"federation": FEDERATION, "coordinator": {"username": "coordinator", "password": "unused"},
                "devices": {d: {"username": d, "password": "unused", "signing_key": new_key()} for d in DEVICES}}
    path.write_text(json.dumps(document))
    return str(path)


def test_every_round_aggregates_every_legitimate_update_under_a_flood(tmp_path):
    # Prepare: Mosquitto queued as broker-config sets it up, but anonymous
    broker = Mosquitto(tmp_path / "broker", extra="\n".join(QUEUE_SETTINGS)).start()
    stop = threading.Event()
    try:
        config = RunConfig.of(algorithm="fedavg", dataset="digits", clients=3, rounds=ROUNDS, min_clients=2,
                              round_timeout=20, registration_timeout=60, local_epochs=1, out=str(tmp_path / "run"),
                              federation=FEDERATION, credentials=credentials(tmp_path / "credentials.json"))
        transport = config.coordinator_transport(broker.url)
        transport.connect()
        coordinator = Coordinator(config, config.coordinator_channel(transport))
        accepted: dict[int, set[str]] = defaultdict(set)
        aggregated: dict[int, int] = {}
        flooder = Flooder(broker.port, coordinator, lambda: transport.counter.total("received"), stop)
        coordinator.subscribe(lambda event: setattr(flooder, "round", event.round), RoundStarted)
        coordinator.subscribe(lambda event: accepted[event.round].add(event.device), UpdateAccepted)
        coordinator.subscribe(lambda event: aggregated.__setitem__(event.round, event.participants), RoundAggregated)
        thread = CoordinatorThread(coordinator)
        thread.start()
        devices = []
        for index, device in enumerate(DEVICES):
            client = EdgeClient(device, load_client_data("digits", num_clients=3, index=index, seed=0),
                                broker=config.mqtt_settings(broker.url, account=device), federation=FEDERATION,
                                state_dir=tmp_path / device)
            devices.append(threading.Thread(target=client.run, args=(stop,), daemon=True, name=device))
        started = time.monotonic()

        # Execute: the flood runs from before registration to the end of the run
        flooder.start()
        for device_thread in devices:
            device_thread.start()
        thread.join(timeout=240)
        stop.set()
        flooder.join(timeout=60)
        seconds = time.monotonic() - started
        transport.close()
        for device_thread in devices:
            device_thread.join(timeout=30)
    finally:
        stop.set()
        broker.stop()

    # Assert
    rejections, report = Counter(coordinator.channel.rejections), thread.report
    print(f"\nflood: sent {dict(flooder.sent)}, {flooder.sent_bytes / 1e9:.2f} GB in {seconds:.0f} s; "
          f"rejections {dict(rejections)}, duplicates {coordinator.channel.duplicates}; "
          f"aggregated {aggregated}; accuracy {report and report['final']['personalized_accuracy']}")
    assert thread.error is None and report is not None, f"coordinator failed: {thread.error!r}"
    assert aggregated == {round_: 3 for round_ in range(1, ROUNDS + 1)}
    assert all(accepted[round_] == set(DEVICES) for round_ in range(1, ROUNDS + 1))
    accuracies = [m["accuracy"] for m in report["final"]["per_client"].values()]
    assert min(accuracies) > 0.8, "a forged update was averaged in"
    assert flooder.sent["hello-8MB"] >= ROUNDS and flooder.sent["forged-sender"] >= ROUNDS
    unread = BACKLOG // HELLO_JUNK + 1  # still in flight when the coordinator stopped reading
    assert rejections["too_large"] >= flooder.sent["hello-8MB"] - unread, "an 8 MB hello got past the size screen"
    assert rejections["bad_signature"] >= flooder.sent["forged-sender"] // 2 + flooder.sent["mutated"] // 2
    assert coordinator.channel.duplicates >= 1
