"""A device says HELLO only once the broker granted its subscriptions: a clustered broker (NATS)
can refuse a subscription under load (the transport retries it), and a HELLO sent meanwhile gets
a WELCOME, or the round's TRAIN after it, that nobody receives (scale.py --cluster lost 4 of 500
updates that way)."""

from __future__ import annotations

import threading

from edge_sdk.channel import Channel
from edge_sdk.loopback import LoopbackBroker
from edge_sdk.protocol import COORDINATOR, Envelope, Kind, Topics
from edge_sdk.session import DeviceSession

FED = "unithello"
WAIT = 30.0


class Device(DeviceSession):
    def hello(self):
        return {"num_examples": 1}, {"device_type": "trainer", "algorithms": ["fedavg"]}

    def join(self, welcome: Envelope) -> None:
        pass


def test_hello_waits_until_the_broker_granted_every_subscription(tmp_path, monkeypatch):
    broker, topics = LoopbackBroker(), Topics(FED)
    coordinator = broker.transport(f"{FED}.coordinator")
    coordinator.connect()
    coordinator.subscribe(topics.all_up())
    channel = Channel(coordinator, topics)
    channel.send(topics.broadcast(Kind.STATUS), Envelope(Kind.STATUS, COORDINATOR, run_id="run1", config={
        "state": "registering", "incarnation": "c1", "epoch": 1}), retain=True)
    transport = broker.transport(f"{FED}.dev1")
    granted = threading.Event()
    # subscriptions that the broker grants only once `granted` is set
    monkeypatch.setattr(transport, "subscriptions_active", granted.is_set, raising=False)
    device = Device("dev1", federation=FED, state_dir=tmp_path, transport=transport, hello_interval=0.0)
    stop = threading.Event()
    runner = threading.Thread(target=device.run, args=(stop,), daemon=True)
    runner.start()
    try:
        assert channel.receive(timeout=2.0) is None, "HELLO sent before the subscriptions were granted"
        granted.set()
        received = channel.receive(timeout=WAIT)
        assert received is not None and received.envelope.kind is Kind.HELLO
        assert received.envelope.sender == "dev1"
    finally:
        stop.set()
        runner.join(timeout=WAIT)
