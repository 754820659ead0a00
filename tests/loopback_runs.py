"""Whole runs over `edge_sdk.loopback.LoopbackBroker`, for the unit tests of a run's behaviour.

A `LoopbackFederation` holds a Coordinator and EdgeClient threads of one federation: every
message is encoded, chunked when large, routed by topic and decoded, exactly as over MQTT, with
no broker process. Test files take the `federation` fixture by importing it; the compute locks
here park a device inside its training so a test can act while a round is open.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from coordinator.run.folder import RunFolder
from edge_sdk import wire
from edge_sdk.channel import Channel
from edge_sdk.loopback import LoopbackBroker, LoopbackTransport
from edge_sdk.protocol import Envelope, Kind, Topics

WAIT = 10.0  # seconds any single expected message may take


class BlockingLock:
    """A compute lock that parks its device inside its first training until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __enter__(self):
        self.entered.set()
        self.release.wait(timeout=120)
        return self

    def __exit__(self, *exc) -> None:
        pass



class Gate:
    """A compute lock that parks its device while closed (it starts closed)."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def __enter__(self):
        self.open.wait(timeout=120)
        return self

    def __exit__(self, *exc) -> None:
        pass



class MissesTheFirstTrain(LoopbackTransport):
    """A connection lost as its device's first TRAIN arrives (broadcast in rounds, on its own topic
    in async steps; one frame: digits' model is far below the chunk size) and made again at once:
    the TRAIN is gone, as for an MQTT client with a clean session, and the device sees a new
    connection, so it says HELLO again."""

    connections = 1

    def deliver(self, topic: str, payload: bytes) -> None:
        if self.connections == 1 and topic.endswith(f"/{Kind.TRAIN.value}"):
            self.connections = 2
            return
        super().deliver(topic, payload)


class DropsItsFirstUpdate(LoopbackTransport):
    """A connection that fails as its device sends its first update (TRAIN_RES): the update is
    lost, the broker publishes the device's Last Will, and the connection is made again at once
    (a new connection: the device says HELLO again)."""

    connections = 1

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        if self.connections == 1 and topic.endswith(f"/{Kind.TRAIN_RES.value}"):
            self.broker.kill(self.client_id)
            self.connections = 2
            self.connect()
            return
        super().publish(topic, payload, qos=qos, retain=retain)


class StallsAtItsFirstRoster(LoopbackTransport):
    """An aggregator's connection whose broker stops delivering to it, without closing the
    connection, as its first ROSTER arrives (a NATS JetStream consumer stalled by a leader
    election): that ROSTER and the first update of `lost_update_from` are lost; what comes on
    the aggregator's other subscriptions still arrives. Delivery resumes once it subscribes again."""

    lost_update_from = "dev002"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stalls = 0
        self.stalled = False

    def subscribe(self, topic_filter: str, qos: int = 1) -> None:
        self.stalled = False
        super().subscribe(topic_filter, qos)

    def deliver(self, topic: str, payload: bytes) -> None:
        if self.stalls == 0 and topic.endswith(f"/{Kind.ROSTER.value}"):
            self.stalls, self.stalled = 1, True
            return
        if self.stalled and (f"/{self.client_id}/" in topic or f"/{self.lost_update_from}/" in topic):
            return
        super().deliver(topic, payload)


class LoopbackFederation:
    """A LoopbackBroker with a Coordinator and EdgeClient threads of one federation."""

    def __init__(self, tmp_path: Path, federation: str):
        self.tmp_path = tmp_path
        self.folder = RunFolder(tmp_path / "run")
        self.topics = Topics(federation)
        self.broker = LoopbackBroker()
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()  # devices take turns to compute: 2 cores are shared

    def config(self, **changes):
        from coordinator.config.run_config import RunConfig

        settings: dict[str, Any] = dict(
            algorithm="fedavg", dataset="digits", clients=3, rounds=2, local_epochs=1, batch_size=64, seed=0,
            federation=self.topics.federation, out=str(self.folder.path), round_timeout=20.0,
            registration_timeout=20.0, quorum_grace=15.0, device="cpu")
        settings.update(changes)
        return RunConfig.of(**settings)

    def state_dir(self, client_id: str) -> Path:
        return self.folder.device_state(client_id)

    def start_device(self, index: int, clients: int, compute_lock=None, attack: str | None = None,
                     wrap=None, secagg_keys=None, transport_type: type[LoopbackTransport] = LoopbackTransport) -> str:
        """Device `index` of `clients` on its digits partition (`wrap(data)` when given), with
        secure-aggregation keys when given, connected through a `transport_type`."""
        from edge_sdk.client import EdgeClient
        from edge_sdk.data import load_client_data

        client_id = f"dev{index:03d}"
        will = (self.topics.up(client_id, Kind.OFFLINE), wire.encode(Envelope(Kind.OFFLINE, client_id)))
        data = load_client_data("digits", num_clients=clients, index=index, seed=0)
        data = data if wrap is None else wrap(data)
        client = EdgeClient(client_id, data, federation=self.topics.federation, state_dir=self.state_dir(client_id),
                            device="cpu", compute_lock=compute_lock or self.lock, attack=attack,
                            transport=transport_type(self.broker, client_id, will=will), secagg_keys=secagg_keys)
        self.run_device(client)
        return client_id

    def start_lite(self, index: int, clients: int, secagg_keys=None):
        """Weak device `index` of `clients` (a LiteClient, returned) on its digits partition, with
        secure-aggregation keys when given."""
        from edge_sdk.data import load_client_data
        from edge_sdk.lite import LiteClient

        client_id = f"dev{index:03d}"
        will = (self.topics.up(client_id, Kind.OFFLINE), wire.encode(Envelope(Kind.OFFLINE, client_id)))
        client = LiteClient(client_id, load_client_data("digits", num_clients=clients, index=index, seed=0),
                            federation=self.topics.federation, state_dir=self.state_dir(client_id),
                            transport=self.broker.transport(client_id, will=will), secagg_keys=secagg_keys)
        self.run_device(client)
        return client

    def start_aggregator(self, shard: int, shards: int, transport_type: type[LoopbackTransport] = LoopbackTransport,
                         resync_after: float | None = None) -> str:
        """The aggregator of shard `shard` of `shards`, connected through a `transport_type`, in a
        thread until the run ends (`resync_after`: its own, else the aggregator's default)."""
        from coordinator.shards.aggregator import RESYNC_AFTER, ShardAggregator

        client_id = f"aggregator-{shard}"
        aggregator = ShardAggregator(shard, shards, federation=self.topics.federation,
                                     transport=transport_type(self.broker, client_id),
                                     resync_after=RESYNC_AFTER if resync_after is None else resync_after)
        self.run_device(aggregator)
        return aggregator.client_id

    def run_device(self, client) -> None:
        """Run `client` (a trainer or a weak device) in a thread until the run ends. A device
        that crashes is announced offline as the broker announces a crashed process (its Last
        Will: the thread's session closed its connection cleanly on the way out, which sends
        none), so the coordinator stops waiting for it and the test fails without a timeout."""
        def run() -> None:
            try:
                client.run(self.stop)
            except BaseException:
                self.announce_offline(client.client_id)
                raise

        thread = threading.Thread(target=run, name=client.client_id, daemon=True)
        thread.start()
        self.threads.append(thread)

    def announce_offline(self, client_id: str) -> None:
        """Publish `client_id`'s Last Will, as the broker does when a device's connection is lost."""
        will = self.broker.transport(f"{client_id}-will")
        will.connect()
        will.publish(self.topics.up(client_id, Kind.OFFLINE), wire.encode(Envelope(Kind.OFFLINE, client_id)))
        will.close()

    def lose_when_parked(self, parked: BlockingLock, client_id: str) -> None:
        """Announce `client_id` offline (its Last Will) once it is parked inside its training by
        `parked`: a device lost mid-round, after it shared its secure-aggregation keys."""
        def announce() -> None:
            parked.entered.wait(60)
            self.announce_offline(client_id)

        threading.Thread(target=announce, daemon=True).start()

    def coordinator(self, config):
        from coordinator.server import Coordinator

        transport = self.broker.transport("coordinator")
        transport.connect()
        return Coordinator(config, Channel(transport, self.topics, chunk_size=config.broker.chunk_size))

    def spy(self, kind: Kind) -> Channel:
        """A bystander that decodes (and reassembles) every upstream message of `kind`."""
        transport = self.broker.transport(f"spy-{kind.value}")
        transport.connect()
        transport.subscribe(f"{self.topics.prefix}/up/+/{kind.value}")
        return Channel(transport, self.topics)

    def devices_exit(self, timeout: float = WAIT) -> bool:
        for thread in self.threads:
            thread.join(timeout)
        return not any(t.is_alive() for t in self.threads)

    def shutdown(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(WAIT)



@pytest.fixture
def quiet_torch(monkeypatch):
    """No curves.png (not under test here) and torch on one thread: devices take turns anyway,
    and more threads only fight over the shared cores."""
    import torch

    monkeypatch.setattr("coordinator.run.report_files.plot_curves", lambda path, report: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def federation(tmp_path, request, quiet_torch):
    fed = LoopbackFederation(tmp_path, f"fed-{request.node.name[5:30].replace('[', '').replace(']', '')}")
    yield fed
    fed.shutdown()



def listener(broker: LoopbackBroker, name: str, topic_filter: str, topics: Topics) -> Channel:
    """A spy on the loopback broker: a channel subscribed to `topic_filter` as client `name`."""
    transport = broker.transport(name)
    transport.connect()
    transport.subscribe(topic_filter)
    return Channel(transport, topics)


def drain(channel: Channel) -> list[Envelope]:
    """Every envelope `channel` has received so far."""
    out = []
    while not channel.transport.incoming.empty():
        received = channel.receive(timeout=0.0)
        if received is not None:
            out.append(received.envelope)
    return out



def metrics_rounds(out: Path) -> list[int]:
    lines = [json.loads(line) for line in RunFolder(out).metrics.read_text().splitlines()]
    return [entry["round"] for entry in lines if entry.get("event") == "round"]



def sealed_test_split(data):
    """`data` whose test split fails any read (its size stays known, for HELLO)."""
    from edge_sdk.data import ClientData

    class SealedTest(ClientData):
        @property
        def test_x(self):
            raise AssertionError("the test split was read")

        @test_x.setter
        def test_x(self, value):
            self._test_x = value

        @property
        def test_y(self):
            raise AssertionError("the test split was read")

        @test_y.setter
        def test_y(self, value):
            self._test_y = value

        @property
        def num_test(self) -> int:
            return len(self._test_y)

    return SealedTest(data.train_x, data.train_y, data.test_x, data.test_y, data.task, data.domain)



def run_in_background(coordinator) -> tuple[threading.Thread, dict, threading.Event]:
    """Start `coordinator.run()` in a thread; the event is set once it listens for devices."""
    from coordinator.events import RegistrationOpened

    listening = threading.Event()
    coordinator.subscribe(lambda event: listening.set(), RegistrationOpened)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(coordinator.run()), daemon=True)
    runner.start()
    return runner, result, listening

