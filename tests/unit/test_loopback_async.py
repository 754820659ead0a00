"""Buffered asynchronous aggregation (`mode async`) over the loopback broker
(tests/loopback_runs.py): every `buffer` arrivals make a new version of the global state, an
update too many versions old is refused and counted, no update is applied twice, and a new
coordinator resumes from the last step's checkpoint."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from coordinator.events import RoundEnded, RoundStarted, UpdateAccepted
from edge_sdk.protocol import Kind
from loopback_runs import Gate, MissesTheFirstTrain, drain, listener, metrics_rounds
from saved_runs import checkpoint_at


def test_every_buffer_of_arrivals_makes_a_step_and_no_update_counts_twice(federation):
    # Prepare: four devices, three training at once, two arrivals a step
    config = federation.config(clients=4, rounds=4, mode="async", buffer=2, concurrency=3, eval_every=4)
    coordinator = federation.coordinator(config)
    accepted: list = []
    coordinator.subscribe(lambda event: accepted.append(event.device), UpdateAccepted)
    uploads = federation.spy(Kind.TRAIN_RES)
    for index in range(4):
        federation.start_device(index, 4)

    # Execute
    report = coordinator.run()

    # Assert: four steps of two arrivals, each arrival a distinct upload answering a TRAIN its device was sent
    steps = [r["asynchronous"] for r in report["rounds"]]
    assert report["rounds_completed"] == 4 and [r["outcome"] for r in report["rounds"]] == ["complete"] * 4
    assert [s["arrivals"] for s in steps] == [2, 2, 2, 2]
    assert report["asynchronous"]["arrivals"] == 8 == len(accepted)
    sent = [(e.sender, e.config["in_reply_to"]) for e in drain(uploads)]
    assert len(set(sent)) == len(sent) >= 8, "each upload answers its own request"
    assert all(s["dispatched"] <= 3 + s["arrivals"] for s in steps), "at most three in flight"
    assert report["final"]["personalized_accuracy"]["mean"] > 0.5


class AfterFirst:
    """A compute lock that lets its device's first computation through, then parks it until `later` is set."""

    def __init__(self) -> None:
        self.later = threading.Event()
        self.entered = 0

    def __enter__(self):
        self.entered += 1
        if self.entered > 1:
            self.later.wait(timeout=120)
        return self

    def __exit__(self, *exc) -> None:
        pass


def test_an_update_more_versions_old_than_allowed_is_refused_and_counted(federation):
    # Prepare: no staleness allowed. dev001 finishes its first training only once dev000's update
    # made version 1; dev000 finishes its second only once dev001 was asked again (its update landed)
    config = federation.config(clients=2, rounds=2, mode="async", buffer=1, max_staleness=0, eval_every=2)
    coordinator = federation.coordinator(config)
    gate, after_first = Gate(), AfterFirst()
    coordinator.subscribe(lambda event: gate.open.set() if event.round == 1 else None, RoundEnded)
    coordinator.subscribe(lambda event: after_first.later.set() if (event.round, event.selected) == (2, ("dev001",))
                          else None, RoundStarted)
    federation.start_device(0, 2, compute_lock=after_first)
    federation.start_device(1, 2, compute_lock=gate)

    # Execute
    report = coordinator.run()

    # Assert: dev001's first update, of version 0 while the state was at version 1, was refused
    first, second = (r["asynchronous"] for r in report["rounds"])
    assert first["arrivals"] == 1 and first["staleness"] == {"0": 1}
    assert second["too_stale"] == 1 and second["arrivals"] == 1 and second["staleness"] == {"0": 1}
    assert report["rejections"] == {"too_stale": 1}
    assert report["asynchronous"]["too_stale"] == 1


def test_a_new_coordinator_resumes_the_steps_from_the_checkpoint(federation):
    # Prepare: an async run of two steps, ended
    config = federation.config(clients=3, rounds=2, mode="async", buffer=2, eval_every=2)
    first = federation.coordinator(config)
    for index in range(3):
        federation.start_device(index, 3)
    first.run()
    first.channel.transport.close()
    assert federation.devices_exit()
    federation.threads.clear()
    after_two = checkpoint_at(Path(config.run.out) / "checkpoint.msgpack")

    # Execute: extended to four steps, with the devices restarted
    second = federation.coordinator(config.replace(rounds=4))
    for index in range(3):
        federation.start_device(index, 3)
    report = second.run()

    # Assert: steps 3 and 4 went on from step 2's state
    assert second.run_id == first.run_id and report["rounds_completed"] == 4
    assert metrics_rounds(Path(config.run.out)) == [1, 2, 3, 4]
    assert [r["asynchronous"]["arrivals"] for r in report["rounds"]] == [2, 2, 2, 2]
    assert report["asynchronous"]["steps"] == 4
    resumed = checkpoint_at(Path(config.run.out) / "checkpoint.msgpack")
    assert resumed.round == 4 and after_two.round == 2
    assert any(not np.array_equal(resumed.state["shared"][k], v) for k, v in after_two.state["shared"].items())


def test_a_device_back_while_training_gets_its_train_again(federation):
    # Prepare: dev001 loses its first TRAIN (a flight expires only after 60 s); dev000 computes
    # only once an update of dev001 was folded
    config = federation.config(clients=2, rounds=2, mode="async", buffer=1, round_timeout=60.0, eval_every=2)
    coordinator = federation.coordinator(config)
    gate = Gate()
    coordinator.subscribe(lambda event: gate.open.set() if event.device == "dev001" else None, UpdateAccepted)
    sent = listener(federation.broker, "spy-train", federation.topics.down("dev001", Kind.TRAIN), federation.topics)
    uploads = federation.spy(Kind.TRAIN_RES)
    federation.start_device(0, 2, compute_lock=gate)
    federation.start_device(1, 2, transport_type=MissesTheFirstTrain)

    # Execute
    report = coordinator.run()

    # Assert: dev001 answered the very TRAIN it lost, sent to it again after its HELLO
    first_train = drain(sent)[0].msg_id
    answered = [e.config["in_reply_to"] for e in drain(uploads) if e.sender == "dev001"]
    assert report["rounds_completed"] == 2
    assert answered and answered[0] == first_train
