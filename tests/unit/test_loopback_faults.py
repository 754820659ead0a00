"""Devices that fail during a run over the loopback broker (tests/loopback_runs.py): killed
mid-round, uploading what is refused, diverging, or the only one: the round is not held up for
them, nothing they send leaks into the model, and the run still ends with its report.
"""

from __future__ import annotations

import logging
import threading

import pytest

from edge_sdk.store import PersonalStore
from loopback_runs import BlockingLock, DropsItsFirstUpdate, MissesTheFirstTrain


def test_a_device_killed_mid_round_is_not_waited_for(federation):
    # Prepare: dev002 parks inside its first training; the others compute normally
    config = federation.config(quorum_grace=15.0, round_timeout=30.0)
    coordinator = federation.coordinator(config)
    parked = BlockingLock()
    federation.start_device(0, 3)
    federation.start_device(1, 3)
    victim = federation.start_device(2, 3, compute_lock=parked)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(coordinator.run()), daemon=True)
    runner.start()
    try:
        assert parked.entered.wait(timeout=30), "round 1 never reached the victim"

        # Execute: the device's process dies; the broker publishes its Last Will
        federation.broker.kill(victim)
        runner.join(timeout=60)
    finally:
        parked.release.set()  # let the parked thread finish; its transport is gone

    # Assert
    assert not runner.is_alive(), "the run did not finish"
    rounds = result["rounds"]
    assert result["rounds_completed"] == 2
    assert (rounds[0]["selected"], rounds[0]["participants"], rounds[0]["outcome"]) == (3, 2, "complete")
    assert (rounds[1]["selected"], rounds[1]["participants"], rounds[1]["outcome"]) == (2, 2, "complete")
    assert victim not in result["final"]["per_client"]
    assert rounds[0]["seconds"] < config.round.quorum_grace  # closed by the Last Will, not by the grace period



@pytest.mark.parametrize("transport_type, quorum", [
    # the TRAIN broadcast is lost as dev002 reconnects; the quorum of 2 does not need it
    (MissesTheFirstTrain, 2),
    # dev002's update is lost with its connection and its Last Will comes first; the quorum of 3
    # needs it, so the round waits for it (without the wait, round 1 would close 2 of 3, aborted)
    (DropsItsFirstUpdate, 3),
], ids=["misses_the_train", "drops_its_update"])
def test_a_device_back_mid_round_gets_the_open_request_again_and_counts(federation, transport_type, quorum):
    # Prepare: the grace is longer than the test waits for a run
    config = federation.config(min_clients=quorum, quorum_grace=60.0, round_timeout=120.0)
    coordinator = federation.coordinator(config)
    federation.start_device(0, 3)
    federation.start_device(1, 3)
    federation.start_device(2, 3, transport_type=transport_type)

    # Execute
    report = coordinator.run()

    # Assert: dev002 trained in round 1 (or sent its cached update again) on the request sent to
    # it again after its HELLO
    rounds = report["rounds"]
    assert [(r["selected"], r["participants"], r["outcome"]) for r in rounds] == [(3, 3, "complete")] * 2
    assert rounds[0]["seconds"] < config.round.quorum_grace


def test_a_device_whose_update_is_rejected_is_not_waited_for(federation):
    # Prepare: dev002 uploads NaN every round; the quorum grace is as long as the timeout, so a
    # round closes as COMPLETE (every device answered) or, after 30 s, at the deadline
    config = federation.config(min_clients=2, quorum_grace=30.0, round_timeout=30.0)
    coordinator = federation.coordinator(config)
    federation.start_device(0, 3)
    federation.start_device(1, 3)
    federation.start_device(2, 3, attack="nan")

    # Execute
    report = coordinator.run()

    # Assert: each round closed as soon as the rejected device had answered, and aggregated the other two
    rounds = report["rounds"]
    assert [(r["selected"], r["participants"], r["outcome"]) for r in rounds] == [(3, 2, "complete")] * 2
    assert [r["rejections"] for r in rounds] == [{"non_finite": 1}] * 2
    assert all(r["seconds"] < config.round.round_timeout for r in rounds)
    assert report["final"]["per_client"]["dev000"]["accuracy"] > 0.5, "the NaN upload leaked into the model"



def test_a_device_whose_training_diverges_keeps_its_last_good_personal_state(federation, caplog):
    # Prepare: a learning rate no model survives; LG-FedAvg keeps a personal body on every device
    config = federation.config(algorithm="lg_fedavg", lr=1e30, min_clients=1, quorum_grace=30.0, round_timeout=30.0)
    coordinator = federation.coordinator(config)
    devices = [federation.start_device(i, 3) for i in range(3)]

    # Execute
    with caplog.at_level("WARNING"):
        report = coordinator.run()

    # Assert: every update was rejected without waiting, and no device stored its diverged state
    rounds = report["rounds"]
    assert [(r["outcome"], r["rejections"]) for r in rounds] == [("aborted", {"non_finite": 3})] * 2
    assert all(r["seconds"] < config.round.round_timeout for r in rounds)
    assert "training diverged in round 1" in caplog.text
    for device in devices:
        assert PersonalStore(federation.state_dir(device), device).load() is None, f"{device} saved a diverged state"



@pytest.mark.parametrize("grad_clip_norm", [0.0, 1e-4])
def test_gradient_clipping_announced_in_welcome_keeps_a_too_large_lr_finite(federation, caplog, grad_clip_norm):
    # Prepare: lr 1e4 throws LG-FedAvg's weights to infinity; clipped at 1e-4 a step moves them by about 1
    config = federation.config(algorithm="lg_fedavg", lr=1e4, grad_clip_norm=grad_clip_norm, min_clients=1,
                               quorum_grace=30.0, round_timeout=30.0)
    coordinator = federation.coordinator(config)
    for i in range(3):
        federation.start_device(i, 3)

    # Execute
    with caplog.at_level("WARNING"):
        report = coordinator.run()

    # Assert
    if not grad_clip_norm:
        assert report["rejections"].get("non_finite", 0) > 0 and "training diverged" in caplog.text
        return
    assert [r["outcome"] for r in report["rounds"]] == ["complete"] * 2
    assert report["rejections"] == {} and "training diverged" not in caplog.text
    assert all(0.0 <= c["accuracy"] <= 1.0 for c in report["final"]["per_client"].values())



def test_a_run_whose_only_device_dies_still_finishes(federation):
    # Prepare: one device, parked in round 1 and killed (waited for 2 s: the quorum needs it);
    # round 2 has nobody to select (it waits its round timeout for a trainer to come online)
    config = federation.config(clients=1, quorum_grace=2.0, round_timeout=10.0)
    coordinator = federation.coordinator(config)
    parked = BlockingLock()
    victim = federation.start_device(0, 1, compute_lock=parked)
    result: dict = {}
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.update(coordinator.run())
        except BaseException as exc:  # surfaced in the assertions below
            errors.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    try:
        assert parked.entered.wait(timeout=30), "round 1 never reached the device"

        # Execute
        federation.broker.kill(victim)
        runner.join(timeout=60)
    finally:
        parked.release.set()

    # Assert: no round can aggregate, but the run ends with a report instead of a crash
    assert not runner.is_alive(), "the run did not finish"
    assert errors == [], f"the coordinator crashed: {errors!r}"
    assert result["rounds_completed"] == 2
    assert [r["outcome"] for r in result["rounds"]] == ["aborted", "aborted"]
    assert [r["participants"] for r in result["rounds"]] == [0, 0]



class Logged(logging.Handler):
    """Sets `seen` once a record containing `text` is logged."""

    def __init__(self, text: str):
        super().__init__()
        self.text, self.seen = text, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.seen.set()


def test_a_round_waits_for_its_quorum_of_trainers_to_be_online(federation, caplog):
    from coordinator.events import UpdateAccepted

    # Prepare: a quorum of all 3; dev002 is lost once its round-1 update is in, and comes back
    # only once the coordinator waits for it before round 2
    config = federation.config(min_clients=3, quorum_grace=30.0, round_timeout=60.0)
    coordinator = federation.coordinator(config)
    waiting = Logged("online trainers")
    caplog.set_level(logging.INFO, logger="coordinator.players.sync")
    logging.getLogger("coordinator.players.sync").addHandler(waiting)

    def on_update(event) -> None:
        if (event.round, event.device) == (1, "dev002"):
            federation.broker.kill("dev002")

    def come_back() -> None:
        if waiting.seen.wait(60):
            federation.start_device(2, 3)

    coordinator.subscribe(on_update, UpdateAccepted)
    for index in range(3):
        federation.start_device(index, 3)
    threading.Thread(target=come_back, daemon=True).start()

    # Execute
    try:
        report = coordinator.run()
    finally:
        logging.getLogger("coordinator.players.sync").removeHandler(waiting)

    # Assert: round 2 started once dev002 was back, and selected it
    assert waiting.seen.is_set()
    assert [(r["selected"], r["participants"]) for r in report["rounds"]] == [(3, 3), (3, 3)]
