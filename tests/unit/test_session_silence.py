"""A device that hears nothing for a while subscribes again, and so learns what it missed.

A broker can stop delivering to a subscription without closing the connection (a NATS
JetStream consumer stalled by a leader election does): the device keeps its connection and
hears nothing, the final STATUS of its run included. Over the loopback broker, with a transport
that turns deaf until its next SUBSCRIBE (what re-creates a stalled consumer) and a clock the
test moves: the joined device that missed the retained STATUS `finished` stays while the
silence is shorter than `silence_interval`, and ends on that STATUS once it is longer.
"""

from __future__ import annotations

import threading
import time

from edge_sdk.channel import Channel
from edge_sdk.loopback import LoopbackBroker, LoopbackTransport
from edge_sdk.protocol import COORDINATOR, Envelope, Kind, Topics
from test_doubles import BareDevice, ManualClock

FED = "silentfed"
WAIT = 10.0
SILENCE = 60.0


class StalledSubscriptions(LoopbackTransport):
    """Delivers nothing while `deaf`; a SUBSCRIBE ends that, as it re-creates a stalled consumer."""

    deaf = False
    subscribes = 0

    def deliver(self, topic: str, payload: bytes) -> None:
        if not self.deaf:
            super().deliver(topic, payload)

    def subscribe(self, topic_filter: str, qos: int = 1) -> None:
        self.deaf = False
        self.subscribes += 1
        super().subscribe(topic_filter, qos)


def status(coordinator: Channel, topics: Topics, state: str) -> None:
    coordinator.send(topics.broadcast(Kind.STATUS), Envelope(
        Kind.STATUS, COORDINATOR, run_id="run-a", round=0,
        config={"state": state, "incarnation": "c1", "epoch": 1, "rounds": 3, "algorithm": "fedavg"}), retain=True)


def test_a_joined_device_that_missed_the_final_status_ends_on_it_after_a_silence():
    # Prepare: a coordinator's connection, and a joined device on a manual clock
    broker, topics, clock = LoopbackBroker(), Topics(FED), ManualClock(1000.0)
    up = broker.transport(f"{FED}.coordinator")
    up.connect()
    up.subscribe(topics.all_up())
    coordinator = Channel(up, topics)
    transport = StalledSubscriptions(broker, f"{FED}.dev1")
    device = BareDevice("dev1", federation=FED, transport=transport, clock=clock, silence_interval=SILENCE)
    status(coordinator, topics, "running")
    stop = threading.Event()
    thread = threading.Thread(target=device.run, args=(stop,), daemon=True)
    thread.start()
    try:
        hello = coordinator.receive(WAIT)
        assert hello is not None and hello.envelope.kind is Kind.HELLO
        coordinator.send(topics.down("dev1", Kind.WELCOME), Envelope(Kind.WELCOME, COORDINATOR, run_id="run-a"))
        deadline, poll = time.monotonic() + WAIT, threading.Event()
        while not device.joined and time.monotonic() < deadline:
            poll.wait(0.05)
        assert device.joined
        subscribed = transport.subscribes

        # Execute: the broker stops delivering, the run finishes, and less than the silence passes
        transport.deaf = True
        status(coordinator, topics, "finished")
        clock.now += SILENCE - 1.0
        thread.join(1.0)

        # Assert: the device still waits, and made no subscription again
        assert thread.is_alive() and not device.finished
        assert transport.subscribes == subscribed

        # Execute: the silence outlasts the interval
        clock.now += 2.0
        thread.join(WAIT)

        # Assert: it subscribed again, got the retained STATUS and ended on it
        assert not thread.is_alive() and device.finished
        assert transport.subscribes == subscribed + len(device.subscriptions())
    finally:
        stop.set()
        thread.join(WAIT)
