"""A release's life over a real Mosquitto, with no training run up: `ReleaseService` answers weak
devices that come online after training, stages new releases to canaries, promotes one whose
accuracy holds, rolls back one that does not (the reason on record), survives its own restart
and the broker's, and an operator's rollback reaches the fleet.

The releases are small onnx.helper bodies (tests/onnx_bodies.py) on digits: random features of
128 and 256 dimensions score well with a logistic-regression head; one of 2 dimensions cannot,
so it is really worse on every device's own data.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from harness.brokers import Mosquitto
from harness.nats_cluster import wait_until
from onnx_bodies import dense_body

from coordinator.releases.inventory import Inventory
from coordinator.releases.service import ReleaseService
from coordinator.releases.store import ReleaseStore
from edge_sdk.channel import Channel
from edge_sdk.data import BUILTIN_TASKS, load_client_data
from edge_sdk.lite import LiteClient
from edge_sdk.protocol import COORDINATOR, Topics
from edge_sdk.transport import MqttSettings, MqttTransport

pytestmark = pytest.mark.integration

FEDERATION = "releases"
RUN = "run-released"
DEVICES = 5
WAIT = 120.0
TASK = BUILTIN_TASKS["digits"]


class Fleet:
    """The release service and weak devices, each in its own thread, over one broker."""

    def __init__(self, broker: Mosquitto, run_dir: Path, tmp_path: Path):
        self.broker, self.url, self.run_dir, self.tmp_path = broker, broker.url, run_dir, tmp_path
        self.stops: list[threading.Event] = []
        self.threads: list[threading.Thread] = []
        self.service_stop: threading.Event | None = None
        self.service_thread: threading.Thread | None = None
        self.transport: MqttTransport | None = None

    def start_service(self) -> ReleaseService:
        self.transport = MqttTransport(f"{FEDERATION}.{COORDINATOR}", MqttSettings(url=self.url))
        self.transport.connect()
        service = ReleaseService(self.run_dir, Channel(self.transport, Topics(FEDERATION)), run_id=RUN, rounds=3,
                                 algorithm="repper", settings={"seed": 0}, num_classes=TASK.num_classes,
                                 canary_timeout=WAIT)
        self.service_stop = threading.Event()
        self.service_thread = threading.Thread(target=service.run, args=(self.service_stop,), daemon=True)
        self.service_thread.start()
        return service

    def stop_service(self) -> None:
        assert self.service_stop is not None and self.service_thread is not None and self.transport is not None
        self.service_stop.set()
        self.service_thread.join(30)
        self.transport.close()

    def start_device(self, index: int) -> LiteClient:
        data = load_client_data("digits", num_clients=DEVICES, index=index, seed=0)
        client = LiteClient(f"weak{index}", data, head="lr", broker=self.url, federation=FEDERATION,
                            state_dir=self.tmp_path / f"weak{index}")
        stop = threading.Event()
        thread = threading.Thread(target=client.run, args=(stop,), daemon=True)
        thread.start()
        self.stops.append(stop)
        self.threads.append(thread)
        return client

    def close(self) -> None:
        for stop in self.stops:
            stop.set()
        for thread in self.threads:
            thread.join(30)
        if self.service_thread is not None and self.service_thread.is_alive():
            self.stop_service()


def reported(run_dir: Path, version: int, devices: list[str]) -> bool:
    """Every one of `devices` reported an evaluation of `version` (the inventory on disk)."""
    inventory = Inventory(run_dir).devices
    return all(inventory.get(device, {}).get("evaluated") == version for device in devices)


def history(run_dir: Path) -> list[tuple[str, int]]:
    return [(entry["action"], entry["version"]) for entry in ReleaseStore(run_dir).read_state().history]


@pytest.fixture
def fleet(mosquitto, tmp_path):
    run_dir = tmp_path / "run"
    store = ReleaseStore(run_dir)
    store.add(dense_body(TASK, hidden=128, seed=0), {"feature_dim": 128}, {"run_id": RUN, "round": 3}, None,
              "released by the training run")
    fleet = Fleet(mosquitto, run_dir, tmp_path)
    yield fleet
    fleet.close()


def test_devices_that_come_online_after_training_personalize_and_releases_roll_out_in_stages(fleet):
    run_dir = fleet.run_dir
    store = ReleaseStore(run_dir)
    fleet.start_service()
    devices = [fleet.start_device(i) for i in range(3)]
    names = [d.client_id for d in devices]
    wait_until(lambda: reported(run_dir, 1, names), WAIT, lambda: f"inventory: {Inventory(run_dir).devices}")
    inventory = Inventory(run_dir).devices
    assert {inventory[name]["runs"] for name in names} == {1}
    assert all(inventory[name]["accuracy"] > 0.7 for name in names), inventory
    assert all(Path(d.model_path).is_file() for d in devices)
    prototypes = run_dir / "releases" / "1" / "prototypes"
    assert sorted(path.stem for path in prototypes.glob("*.npz")) == names  # class means, pooled for the next

    # a worse release: its canaries score lower, so it is rolled back and they keep release 1
    worse = store.add(dense_body(TASK, hidden=2, seed=0), {"feature_dim": 2}, {"file": "worse.onnx"}, None, "test")
    store.request_rollout(worse.version, fraction=0.5, tolerance=0.01)
    wait_until(lambda: ("rolled back", worse.version) in history(run_dir), WAIT,
               lambda: f"history: {history(run_dir)}")
    state = store.read_state()
    assert state.current == 1 and state.rollout is None
    reason = [e["reason"] for e in state.history if e["action"] == "rolled back"][-1]
    assert "canaries scored" in reason and "beyond the tolerance" in reason
    canaries = [e["reason"] for e in state.history if e["action"] == "canaries"][-1].split(", ")
    assert len(canaries) == 2  # half of the three devices, rounded up
    # the canaries are sent release 1 back; nobody ever deployed the worse release
    wait_until(lambda: reported(run_dir, 1, canaries), WAIT, lambda: f"inventory: {Inventory(run_dir).devices}")
    assert all(Inventory(run_dir).devices[name]["runs"] == 1 for name in names)
    assert all(device.deployed.version == 1 for device in devices)

    # the service restarts; a better release is promoted after its canaries and reaches everyone
    fleet.stop_service()
    fleet.start_service()
    better = store.add(dense_body(TASK, hidden=256, seed=1), {"feature_dim": 256}, {"file": "better.onnx"}, None,
                       "test")
    store.request_rollout(better.version, fraction=0.5, tolerance=0.05)
    wait_until(lambda: reported(run_dir, better.version, names), WAIT, lambda: f"history: {history(run_dir)}")
    assert store.read_state().current == better.version
    assert ("promoted", better.version) in history(run_dir)

    # a device that comes online now deploys the current release
    late = fleet.start_device(3)
    wait_until(lambda: reported(run_dir, better.version, [late.client_id]), WAIT,
               lambda: f"inventory: {Inventory(run_dir).devices}")
    assert Inventory(run_dir).devices[late.client_id]["runs"] == better.version

    # the broker restarts, its retained messages lost: the service announces itself and the release
    # again, and a device that comes online after the outage still gets them
    fleet.broker.stop()
    fleet.broker.start()
    later = fleet.start_device(4)
    wait_until(lambda: reported(run_dir, better.version, [later.client_id]), WAIT,
               lambda: f"inventory: {Inventory(run_dir).devices}")

    # the operator rolls back: every online device is sent release 1 again and follows it
    assert store.roll_back("test rollback") == 1
    everyone = [*names, late.client_id, later.client_id]
    wait_until(lambda: all(Inventory(run_dir).devices[n]["runs"] == 1 for n in everyone), WAIT,
               lambda: f"inventory: {Inventory(run_dir).devices}")
    assert ("rolled back", better.version) in history(run_dir)
