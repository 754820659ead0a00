"""Stand-ins the tests share: a transport that only records what is published, a thread that
runs a coordinator and keeps its report or error for the test's assertions, a device session
that needs nothing to join, and a clock the test moves."""

from __future__ import annotations

import threading

from edge_sdk.counters import ByteCounter
from edge_sdk.flow import IncomingQueue
from edge_sdk.protocol import Envelope
from edge_sdk.session import DeviceSession


class Wire:
    """A transport that keeps what is published (connecting and subscribing do nothing); its
    queue is the one a channel reads (and screens), filled by the test."""

    def __init__(self, client_id: str = "dev1"):
        self.client_id = client_id
        self.counter = ByteCounter()
        self.incoming = IncomingQueue()
        self.published: list[tuple[str, bytes]] = []

    def connect(self) -> None: ...
    def close(self) -> None: ...
    def subscribe(self, topic_filter: str, qos: int = 1) -> None: ...

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        self.published.append((topic, bytes(payload)))


class CoordinatorThread(threading.Thread):
    """`coordinator.run()` on a daemon thread; `report` or `error` once it ends."""

    def __init__(self, coordinator):
        super().__init__(daemon=True, name="coordinator")
        self.coordinator = coordinator
        self.report: dict | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.report = self.coordinator.run()
        except BaseException as exc:  # surfaced by the test's assertions
            self.error = exc


class BareDevice(DeviceSession):
    """A lite device of one example that joins any run: the session's rules, nothing else."""

    def hello(self):
        return {"num_examples": 1}, {"device_type": "lite"}

    def join(self, welcome: Envelope) -> None:
        pass


class ManualClock:
    """A clock that stands still until the test moves `now` (a session's timers read it)."""

    def __init__(self, now: float = 5000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
