"""`DeviceSession.handle`: a caller that hands a device its envelopes itself (the in-process
baseline of benchmarks/overhead.py) gets what `run` does on receipt: WELCOME joins, the device's
own handlers answer its requests through `send`, other kinds are ignored, and a refusal raises."""

from __future__ import annotations

import pytest

from edge_sdk.loopback import LoopbackBroker
from edge_sdk.protocol import COORDINATOR, Envelope, Kind
from edge_sdk.session import DeviceSession, RegistrationRefused


class Device(DeviceSession):
    """Joins any run; answers TRAIN with the round it was asked for; keeps what it sends."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.joined_runs: list[str] = []
        self.sent: list[Envelope] = []

    def hello(self):
        return {"num_examples": 1}, {"device_type": "trainer", "algorithms": ["fedavg"]}

    def join(self, welcome: Envelope) -> None:
        self.joined_runs.append(welcome.run_id)

    def handlers(self):
        return {Kind.TRAIN: lambda task: self.send(Kind.TRAIN_RES, task.round, request=task, metrics={"n": 1})}

    def send(self, kind, round_=0, *, request=None, **fields) -> None:
        self.sent.append(Envelope(kind, self.client_id, run_id=self.run_id or "", round=round_, **fields))


@pytest.fixture
def device(tmp_path) -> Device:
    return Device("dev1", federation="unithandle", state_dir=tmp_path, transport=LoopbackBroker().transport("dev1"))


def test_handle_joins_on_welcome_and_answers_a_request_through_send(device):
    # Execute
    device.handle(Envelope(Kind.WELCOME, COORDINATOR, run_id="run1", config={}))
    device.handle(Envelope(Kind.TRAIN, COORDINATOR, run_id="run1", round=3, config={"selected": ["dev1"]}))
    device.handle(Envelope(Kind.HELLO, "dev2", run_id="run1"))  # not a downstream kind: ignored

    # Assert
    assert device.joined_runs == ["run1"] and device.run_id == "run1" and device.joined
    assert [(e.kind, e.round, e.run_id) for e in device.sent] == [(Kind.TRAIN_RES, 3, "run1")]


def test_handle_raises_a_refused_registration(device):
    # Execute / Assert: the caller learns why, nothing is joined
    with pytest.raises(RegistrationRefused, match="duplicate id"):
        device.handle(Envelope(Kind.WELCOME, COORDINATOR, run_id="run1", config={"refused": "duplicate id"}))
    assert not device.joined and device.joined_runs == []
