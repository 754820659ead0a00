"""The in-process round harness: one round of a server algorithm with its devices, through the
wire encoding and the coordinator's own update checks."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.aggregation.validation import UpdateLimits
from coordinator.algorithms import load as load_server
from coordinator.algorithms.base import ServerContext
from coordinator.rounds.inprocess import FixedUpdate, InProcessRound, play_round
from edge_sdk import wire
from edge_sdk.algorithms.part_sharing import SHARED
from edge_sdk.data import BUILTIN_TASKS
from edge_sdk.protocol import Envelope, Kind, Reason, ValidationError


def make_server(algorithm_id: str = "fedavg"):
    cls = load_server(algorithm_id)
    return cls(cls.Hyper(), ServerContext("cnn8", BUILTIN_TASKS["digits"], seed=0, rounds=2, clients=2))


def filled(server, value: float) -> dict:
    return {SHARED: {k: np.full_like(v, value) for k, v in server.state[SHARED].items()}}


def test_a_round_folds_the_updates_in_by_their_examples_and_counts_the_bytes() -> None:
    # Prepare
    server = make_server()
    devices = {"dev000": FixedUpdate(filled(server, 1.0), 30), "dev001": FixedUpdate(filled(server, 5.0), 10)}
    task = Envelope(Kind.TRAIN, "coordinator", run_id="in-process", round=1, groups=server.task_groups(1),
                    config={"selected": list(devices), **server.task_config(1)})

    # Execute
    played = play_round(server, devices, 1)

    # Assert: (30 * 1 + 10 * 5) / 40 = 2, and the sizes are those of the encoded messages
    assert all(np.allclose(v, 2.0) for v in server.state[SHARED].values())
    assert played.weights == {"dev000": 30.0, "dev001": 10.0}
    assert played.bytes_down == len(wire.encode(task))
    for client_id, device in devices.items():
        reply = Envelope(Kind.TRAIN_RES, client_id, run_id="in-process", round=1, groups=device.groups,
                         metrics={"num_examples": device.num_examples})
        assert played.bytes_up[client_id] == len(wire.encode(reply))
    assert played.results["dev001"].metrics == {"num_examples": 10}


def test_an_update_the_coordinator_would_refuse_raises_with_its_reason() -> None:
    # Prepare: one array with the wrong shape
    server = make_server()
    update = filled(server, 1.0)
    name = next(iter(update[SHARED]))
    update[SHARED][name] = np.zeros(3, np.float32)

    # Execute
    with pytest.raises(ValidationError) as error:
        play_round(server, {"dev000": FixedUpdate(update, 10)}, 1)

    # Assert
    assert error.value.reason is Reason.BAD_SHAPE


def test_the_coordinator_side_alone_caps_the_weight_at_the_registered_examples() -> None:
    # Prepare
    server = make_server()
    training = InProcessRound(server, 1, ["dev000"], limits=UpdateLimits(max_examples=1000, max_update_norm=0.0))
    reply = wire.decode(wire.encode(Envelope(Kind.TRAIN_RES, "dev000", round=1, groups=filled(server, 3.0),
                                             metrics={"num_examples": 500})))

    # Execute
    weight = training.accept(reply, registered_examples=20)
    training.finish()

    # Assert
    assert weight == 20.0 and training.weights == {"dev000": 20.0}
    assert all(np.allclose(v, 3.0) for v in server.state[SHARED].values())
    assert training.task.config["selected"] == ["dev000"] and training.task.round == 1
