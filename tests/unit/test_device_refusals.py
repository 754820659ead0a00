"""A device that cannot take a request of its run addressed to it says so upward, and the
coordinator counts that as its answer: a round whose every device refused stops the run at
once with the reason, instead of waiting out its timeout. Devices that do not report (older
ones) still work, with the timeout as before."""

from __future__ import annotations

import pytest
from loopback_runs import drain, listener

from coordinator.rounds.collector import EveryDeviceRefused, every_device_refused
from edge_sdk.protocol import (COORDINATOR, MAX_REFUSAL_DETAIL, Envelope, Kind, ProtocolError, Reason, Refusal,
                               refusal_of)
from edge_sdk.session import DeviceSession

SHARED = "shared"


def reply(**config) -> Envelope:
    return Envelope(Kind.TRAIN_RES, "dev000", run_id="r", round=1, config={"in_reply_to": "m", **config})


def test_a_refusal_is_read_strictly():
    assert refusal_of(reply()) is None
    assert refusal_of(reply(refused="bad_shape", detail="shared/w")) == Refusal(Reason.BAD_SHAPE, "shared/w")
    for bad in ({"refused": "no_such_reason", "detail": ""}, {"refused": "bad_shape"},
                {"refused": "bad_shape", "detail": "x" * (MAX_REFUSAL_DETAIL + 1)}, {"refused": 3, "detail": ""}):
        with pytest.raises(ProtocolError) as refused:
            refusal_of(reply(**bad))
        assert refused.value.reason is Reason.MALFORMED
    with_metrics = Envelope(Kind.TRAIN_RES, "dev000", run_id="r", round=1, metrics={"num_examples": 3.0},
                            config={"refused": "bad_shape", "detail": ""})
    with pytest.raises(ProtocolError, match="no arrays and no metrics"):
        refusal_of(with_metrics)


def test_the_stop_needs_every_device_asked_to_have_refused():
    refusals = {"a": Refusal(Reason.BAD_SHAPE, "shared/w: got [1], want []"), "b": Refusal(Reason.BAD_DTYPE, "x")}
    stop = every_device_refused("train", 2, ["a", "b"], [], refusals)
    assert isinstance(stop, EveryDeviceRefused)
    assert str(stop) == ("round 2: every device asked (2) refused the train (bad_dtype, bad_shape); a: shared/w: "
                         "got [1], want []")
    assert every_device_refused("train", 2, ["a", "b", "c"], [], refusals) is None  # c did not say
    assert every_device_refused("train", 2, ["a", "b"], ["b"], refusals) is None  # b answered after all
    assert every_device_refused("train", 2, [], [], refusals) is None


def broken_broadcast(coordinator) -> str:
    """Turn one array of the global state 1-d, as a warm start once did, past the coordinator's
    own check (a bug it does not catch): every device must refuse what is sent."""
    state = coordinator.algorithm.state[SHARED]
    name = next(key for key in state if key.endswith("num_batches_tracked"))
    state[name] = state[name].reshape(1)
    coordinator.algorithm.check_outgoing = lambda what, groups: None
    return name


def test_a_round_every_device_refused_stops_the_run_with_the_reason(federation):
    # Prepare
    # (the refusals come within a second; a round without them would wait its 30 s and play on)
    coordinator = federation.coordinator(federation.config(algorithm="repper", rounds=1, round_timeout=30.0))
    name = broken_broadcast(coordinator)
    replies = listener(federation.broker, "reply-spy", federation.topics.prefix + "/up/+/train_res", federation.topics)
    for i in range(3):
        federation.start_device(i, 3)

    # Execute
    with pytest.raises(EveryDeviceRefused) as stopped:
        coordinator.run()

    # Assert: each device answered with its refusal and nothing else; the run says why it stopped
    assert str(stopped.value).startswith("round 1: every device asked (3) refused the train (bad_shape); dev000: ")
    assert f"{SHARED}/{name}: got int64[1], want int64[]" in str(stopped.value)
    refusals = [e for e in drain(replies) if e.kind is Kind.TRAIN_RES]
    assert sorted(e.sender for e in refusals) == ["dev000", "dev001", "dev002"]
    assert all((refusal := refusal_of(e)) is not None and refusal.reason is Reason.BAD_SHAPE for e in refusals)
    assert all(not e.groups and not e.metrics for e in refusals)

    # Execute: the same broken TRAIN for another run, and for nobody, then one for dev000
    def train(run_id: str, selected: list[str]) -> Envelope:
        return Envelope(Kind.TRAIN, COORDINATOR, run_id=run_id, round=3, config={"selected": selected},
                        groups={SHARED: coordinator.algorithm.state[SHARED]})

    silent = [train("another-run", ["dev000"]), train(coordinator.run_id, [])]
    answered = train(coordinator.run_id, ["dev000"])
    for envelope in [*silent, answered]:
        coordinator.channel.send(federation.topics.down("dev000", Kind.TRAIN), envelope)
    received: list[Envelope] = []
    while answered.msg_id not in [e.config.get("in_reply_to") for e in received]:
        reply = replies.receive(timeout=30)
        assert reply is not None, "dev000 never refused the TRAIN addressed to it"
        received.append(reply.envelope)

    # Assert: delivered in order, so the two before it were read and left unanswered
    assert [e.config.get("in_reply_to") for e in received] == [answered.msg_id]


def test_devices_that_do_not_report_leave_the_round_to_its_timeout(federation, monkeypatch):
    # Prepare: devices as they were before they reported refusals
    monkeypatch.setattr(DeviceSession, "_refuse_upward", lambda self, request, reason, detail: None)
    coordinator = federation.coordinator(federation.config(algorithm="repper", rounds=1, round_timeout=2.0))
    broken_broadcast(coordinator)
    for i in range(3):
        federation.start_device(i, 3)

    # Execute
    report = coordinator.run()

    # Assert: the round waited out its timeout and aggregated nothing; nobody said why
    assert [r["outcome"] for r in report["rounds"]] == ["aborted"]
    assert report["rounds"][0]["replied"] == 0 and report["device_refusals"] == {}
    assert report["final"]["per_client"] == {}
