"""Whole secure-aggregation rounds in memory: the server gets the survivors' exact sum, with dropouts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_sdk.secagg import FixedPoint, RoundFailed, SecAggError, effective_degree
from secagg_rounds import (AFTER_ADVERTISE, AFTER_CONFIRM, AFTER_MASK, AFTER_SHARE, BEFORE_ADVERTISE, COMPLETE, Round,
                           advertise, play, random_inputs, round_context, share_keys, start_round, unmask)

FATES = [BEFORE_ADVERTISE, AFTER_ADVERTISE, AFTER_SHARE, AFTER_MASK, AFTER_CONFIRM] + [COMPLETE] * 20


def too_few_shares(trial: Round) -> bool:
    """Whether some secret the server needs has fewer than threshold holders among the responders."""
    server, graph, threshold = trial.server, trial.context.graph, trial.context.threshold
    needed = list(server.survivors) + [v for v in server.dropped if graph[v] & server.survivors]
    return not server.survivors or any(len(graph[owner] & trial.responders) < threshold for owner in needed)


@settings(max_examples=25, deadline=None)
@given(count=st.integers(3, 12), degree=st.integers(1, 11), length=st.integers(1, 2000), seed=st.integers(0, 2**32),
       data=st.data())
def test_the_unmasked_sum_is_the_survivors_exact_sum_or_the_round_fails_for_want_of_shares(
        count, degree, length, seed, data):
    # Prepare
    reach = effective_degree(count, degree)
    context = round_context(count, data.draw(st.integers(reach // 2 + 1, reach), label="threshold"), degree, length)
    fates = dict(zip(context.participants, data.draw(st.lists(st.sampled_from(FATES), min_size=count,
                                                              max_size=count), label="fates"), strict=True))
    trial = play(context, random_inputs(context, np.random.default_rng(seed)), fates)

    # Execute
    try:
        total = trial.server.result()
    except RoundFailed:
        total = None

    # Assert
    assert (total is None) == too_few_shares(trial)
    if total is not None:
        np.testing.assert_array_equal(total, trial.expected_sum())


def test_a_round_without_dropouts_sums_every_input():
    # Prepare
    context = round_context(count=10, threshold=3, degree=4, length=3000)
    trial = play(context, random_inputs(context, np.random.default_rng(1)), {})

    # Execute
    total = trial.server.result()

    # Assert
    assert trial.server.survivors == set(context.participants)
    np.testing.assert_array_equal(total, trial.expected_sum())


def test_a_round_survives_a_dropout_at_every_stage():
    # Prepare: degree 10, threshold 6: each device keeps at least 6 neighbours whichever 4 drop
    context = round_context(count=12, threshold=6, degree=10, length=2000)
    fates = {"dev00": BEFORE_ADVERTISE, "dev03": AFTER_ADVERTISE, "dev05": AFTER_SHARE, "dev07": AFTER_MASK}
    trial = play(context, random_inputs(context, np.random.default_rng(2)), fates)

    # Execute
    total = trial.server.result()

    # Assert: dev07's input counts (its masked vector arrived), dev05's does not (it dropped after sharing)
    assert trial.server.survivors == set(context.participants) - {"dev00", "dev03", "dev05"}
    assert trial.server.dropped == {"dev05"}
    np.testing.assert_array_equal(total, trial.expected_sum())


def test_too_few_unmask_responses_fail_the_round_naming_the_shortfall():
    # Prepare: 6 devices, degree 4 (each misses one), threshold 3; two never answer the unmask request,
    # so a device next to both has exactly 2 shares of its self-mask seed revealed
    context = round_context(count=6, threshold=3, degree=4, length=100)
    fates = {"dev00": AFTER_CONFIRM, "dev01": AFTER_CONFIRM}
    trial = play(context, random_inputs(context, np.random.default_rng(3)), fates)

    # Execute / Assert
    with pytest.raises(RoundFailed, match=r"self-mask seed: 2 of 3 shares"):
        trial.server.result()


def test_float_updates_aggregate_through_fixed_point():
    # Prepare
    context = round_context(count=8, threshold=3, degree=4, length=500)
    codec = FixedPoint(bound=1.0, summands=8)
    rng = np.random.default_rng(4)
    floats = {device: rng.uniform(-1, 1, 500) for device in context.participants}
    trial = play(context, {device: codec.encode(values, rng) for device, values in floats.items()}, {})

    # Execute
    mean = codec.decode_sum(trial.server.result()) / 8

    # Assert
    np.testing.assert_allclose(mean, np.mean(list(floats.values()), axis=0), atol=codec.max_error_per_summand)


def test_a_masked_sum_summed_elsewhere_unmasks_to_its_devices_exact_sum():
    # Prepare: a shard's aggregator adds the masked vectors up (mod 2^32); dev04 dropped after sharing
    context = round_context(count=8, threshold=4, degree=6, length=1500)
    trial = start_round(context, random_inputs(context, np.random.default_rng(5)))
    shared = share_keys(trial, list(context.participants), advertise(trial, list(context.participants)))
    summed = [device for device in shared if device != "dev04"]
    total = np.zeros(context.vector_length, dtype=np.uint32)
    for device in summed:
        total += trial.clients[device].mask(trial.inputs[device])

    # Execute
    trial.server.add_masked_sum(summed, total)
    unmask(trial, summed)

    # Assert
    assert trial.server.survivors == set(summed) and trial.server.dropped == {"dev04"}
    np.testing.assert_array_equal(trial.server.result(), trial.expected_sum())


def test_a_masked_sum_over_a_device_that_did_not_share_or_twice_over_one_is_refused():
    context = round_context(count=6, threshold=3, degree=4, length=100)
    trial = start_round(context, random_inputs(context, np.random.default_rng(6)))
    devices = list(context.participants)
    share_keys(trial, devices[:-1], advertise(trial, devices[:-1]))
    zeros = np.zeros(context.vector_length, dtype=np.uint32)
    with pytest.raises(SecAggError, match=f"{devices[-1]}'?, which did not share keys"):
        trial.server.add_masked_sum(devices[-2:], zeros)
    trial.server.add_masked_sum(devices[:2], zeros)
    with pytest.raises(SecAggError, match="already summed"):
        trial.server.add_masked_sum(devices[1:3], zeros)
    with pytest.raises(SecAggError, match="uint32 vector of length 100"):
        trial.server.add_masked_sum(devices[3:4], np.zeros(99, dtype=np.uint32))
