"""The coordinator looks at what it is about to send: a broadcast every device would refuse (a
name, dtype or shape other than the model's, a non-finite value) stops the run at once, naming
the array, instead of a round that waits out its timeout for answers that cannot come."""

from __future__ import annotations

import numpy as np
import pytest
from loopback_runs import drain, listener

from coordinator.algorithms.outgoing import OutgoingError, check_outgoing
from edge_sdk.protocol import Kind

SHARED = "shared"
SPEC = {SHARED: {"w": ((2, 3), "float32"), "n": ((), "int64")}}


def arrays(**changes):
    group = {"w": np.zeros((2, 3), np.float32), "n": np.zeros((), np.int64)}
    group.update(changes)
    return {SHARED: group}


def test_arrays_as_the_model_has_them_pass():
    check_outgoing("the train of round 1", arrays(), SPEC)
    check_outgoing("the train of round 1", {"means": {"m": np.ones(4, np.float32)}}, SPEC)  # not the model's


@pytest.mark.parametrize("changes, named", [
    ({"n": np.zeros(1, np.int64)}, r"shared/n is int64\[1\] but the run's model has int64\[\]"),
    ({"w": np.zeros((2, 3), np.float64)}, r"shared/w is float64\[2, 3\] but the run's model has float32\[2, 3\]"),
    ({"w": np.full((2, 3), np.nan, np.float32)}, r"shared/w has non-finite values"),
    ({"x": np.zeros(1, np.float32)}, r"shared lacks \[\] and has \['x'\] beyond the run's model"),
])
def test_what_a_device_would_refuse_is_refused_naming_the_array(changes, named):
    with pytest.raises(OutgoingError, match=rf"^the train of round 3: {named}"):
        check_outgoing("the train of round 3", arrays(**changes), SPEC)


def test_a_sliced_broadcast_may_carry_a_leading_slice_and_no_more():
    check_outgoing("the train of round 2", arrays(w=np.zeros((1, 3), np.float32)), SPEC, sliced=True)
    with pytest.raises(OutgoingError, match=r"shared/w is float32\[3, 3\]"):
        check_outgoing("the train of round 2", arrays(w=np.zeros((3, 3), np.float32)), SPEC, sliced=True)
    with pytest.raises(OutgoingError, match=r"shared/w is float32\[1, 3\]"):
        check_outgoing("the train of round 2", arrays(w=np.zeros((1, 3), np.float32)), SPEC)


def test_a_run_whose_broadcast_every_device_would_refuse_stops_before_sending_it(federation):
    # Prepare: RepPer broadcasts its BatchNorm statistics; one of them turned 1-d, as a warm start once did
    coordinator = federation.coordinator(federation.config(algorithm="repper", rounds=2, round_timeout=240.0))
    state = coordinator.algorithm.state[SHARED]
    name = next(key for key in state if key.endswith("num_batches_tracked"))
    state[name] = state[name].reshape(1)
    trains = listener(federation.broker, "train-spy", federation.topics.broadcast(Kind.TRAIN), federation.topics)
    for i in range(3):
        federation.start_device(i, 3)

    # Execute
    with pytest.raises(OutgoingError) as refused:
        coordinator.run()

    # Assert: named, and stopped before the broadcast went out (a round would wait 240 s for refusals)
    assert str(refused.value).startswith(f"the train of round 1: shared/{name} is int64[1] but the run's model has "
                                         "int64[]")
    assert [e for e in drain(trains) if e.kind is Kind.TRAIN] == []
