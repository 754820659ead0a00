"""A device with nobody to talk to says so, and says HELLO only where a coordinator can answer.

Over the loopback broker, on a clock the test moves (the session's timers read it): a device
started after a run finished sees the retained STATUS `finished`, says once that it waits for a
coordinator of its federation and what it saw last, says it again every `notice_interval`, and
sends no HELLO until a new coordinator announces itself; a device that sees no STATUS at all
says HELLO every `hello_interval` and says it waits once the first one went unanswered.
"""

from __future__ import annotations

import logging
import queue
import threading

import pytest

from edge_sdk.channel import Channel
from edge_sdk.loopback import LoopbackBroker
from edge_sdk.protocol import COORDINATOR, Envelope, Kind, Topics
from edge_sdk.session import waiting_log
from test_doubles import BareDevice, ManualClock

FED = "waitfed"
WAIT = 10.0


class Notices(logging.Handler):
    """The waiting notices, as they are logged."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: queue.Queue[str] = queue.Queue()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.put(record.getMessage())

    def next(self) -> str:
        return self.lines.get(timeout=WAIT)


@pytest.fixture
def notices():
    handler, level = Notices(), waiting_log.level
    waiting_log.addHandler(handler)
    waiting_log.setLevel(logging.INFO)
    yield handler
    waiting_log.removeHandler(handler)
    waiting_log.setLevel(level)


class Fleet:
    """A loopback broker, a coordinator's connection to it, and a device on a manual clock."""

    def __init__(self) -> None:
        self.broker, self.topics, self.clock = LoopbackBroker(), Topics(FED), ManualClock()
        transport = self.broker.transport(f"{FED}.coordinator")
        transport.connect()
        transport.subscribe(self.topics.all_up())
        self.coordinator = Channel(transport, self.topics)
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def status(self, state: str, incarnation: str, run_id: str = "run-a", rounds: int = 3) -> None:
        self.coordinator.send(self.topics.broadcast(Kind.STATUS), Envelope(
            Kind.STATUS, COORDINATOR, run_id=run_id, round=rounds,
            config={"state": state, "incarnation": incarnation, "epoch": 1, "rounds": rounds, "algorithm": "fedavg"}),
            retain=True)

    def start(self) -> BareDevice:
        device = BareDevice("dev1", federation=FED, transport=self.broker.transport(f"{FED}.dev1"), clock=self.clock,
                            hello_interval=15.0, notice_interval=300.0)
        self.thread = threading.Thread(target=device.run, args=(self.stop,), daemon=True)
        self.thread.start()
        return device

    def hellos(self, timeout: float) -> list[Envelope]:
        """The HELLOs received within `timeout` seconds of the first (none if none came)."""
        out, received = [], self.coordinator.receive(timeout)
        while received is not None:
            out.append(received.envelope)
            received = self.coordinator.receive(0.2)
        return [e for e in out if e.kind is Kind.HELLO]

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(WAIT)


@pytest.fixture
def fleet():
    fleet = Fleet()
    yield fleet
    fleet.close()


def test_a_device_after_a_finished_run_says_it_waits_and_says_no_hello_into_nothing(fleet, notices):
    # Prepare: the broker keeps the finished run's STATUS
    fleet.status("finished", "c1")

    # Execute: the device starts, and a minute passes
    fleet.start()
    first = notices.next()
    fleet.clock.now += 60.0

    # Assert: it said at once what it waits for and what it saw, and sent no HELLO
    assert first == ("dev1: waiting for a coordinator of federation waitfed; last seen: run run-a finished after 3 "
                     "rounds (a new coordinator's status will be answered)")
    assert fleet.hellos(1.0) == []

    # Execute: five minutes later it says so again, still without a HELLO
    fleet.clock.now += 240.0
    again = notices.next()
    assert again == first
    assert fleet.hellos(0.5) == []

    # Execute: a new coordinator announces itself
    fleet.status("registering", "c2", run_id="run-b", rounds=0)

    # Assert: it answers that coordinator with one HELLO
    assert [h.sender for h in fleet.hellos(WAIT)] == ["dev1"]


def test_a_device_that_sees_no_status_says_hello_every_interval_and_that_it_waits(fleet, notices):
    # Prepare: an empty broker
    fleet.start()

    # Execute: the first HELLO interval passes unanswered
    fleet.clock.now += 15.5
    hellos = fleet.hellos(WAIT)
    first = notices.next()

    # Assert
    assert [h.sender for h in hellos] == ["dev1"]
    assert first == "dev1: waiting for a coordinator of federation waitfed; no coordinator status seen yet (HELLO " \
                    "every 15 s)"

    # Execute / Assert: it goes on saying HELLO, and repeats the notice only every five minutes
    fleet.clock.now += 15.5
    assert len(fleet.hellos(WAIT)) == 1
    assert notices.lines.empty()
    fleet.clock.now += 300.0
    assert notices.next() == first


def test_a_joined_device_says_nothing_of_waiting(fleet, notices):
    # Prepare: a live coordinator that answers the HELLO
    fleet.status("registering", "c1", run_id="run-a", rounds=0)
    device = fleet.start()
    (hello,) = fleet.hellos(WAIT)
    fleet.coordinator.send(fleet.topics.down("dev1", Kind.WELCOME),
                           Envelope(Kind.WELCOME, COORDINATOR, run_id="run-a", config={"incarnation": "c1"}))

    # Execute: the device joins, then time passes
    while not device.joined:
        assert fleet.coordinator.receive(0.1) is None
    fleet.clock.now += 1000.0
    assert fleet.hellos(1.0) == []

    # Assert
    assert hello.sender == "dev1"
    assert notices.lines.empty()
