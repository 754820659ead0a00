"""Fixed-point encoding of floats into Z_{2^32}: sums decode within n/scale, rounding is unbiased."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_sdk.secagg import FixedPoint, SecAggError


def ring_sum(encodings: list[np.ndarray]) -> np.ndarray:
    total = np.zeros_like(encodings[0])
    for encoding in encodings:
        total += encoding
    return total


@settings(max_examples=25, deadline=None)
@given(summands=st.integers(1, 50), bound=st.floats(1e-3, 1e3), seed=st.integers(0, 2**32 - 1),
       length=st.integers(1, 500))
def test_the_sum_of_encodings_decodes_within_n_over_scale(summands, bound, seed, length):
    # Prepare: values inside the bound, some at the extremes
    rng = np.random.default_rng(seed)
    codec = FixedPoint(bound, summands)
    values = [rng.uniform(-bound, bound, length) for _ in range(summands)]
    values[0][0] = bound
    values[-1][-1] = -bound

    # Execute
    decoded = codec.decode_sum(ring_sum([codec.encode(v, rng) for v in values]))

    # Assert
    assert np.all(np.abs(decoded - np.sum(values, axis=0)) <= summands * codec.max_error_per_summand)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_sum_at_the_bound_does_not_wrap(sign):
    # Prepare: the largest sum allowed, with rounding pushing it outward
    codec = FixedPoint(bound=0.7, summands=9)
    rng = np.random.default_rng(0)

    # Execute
    decoded = codec.decode_sum(ring_sum([codec.encode(np.full(1000, sign * 0.7), rng) for _ in range(9)]))

    # Assert
    assert np.all(np.abs(decoded - sign * 6.3) <= 9 / codec.scale)


def test_stochastic_rounding_is_unbiased():
    # Prepare: a value 0.3 units above a grid point; floor would be biased by 0.3 units
    codec = FixedPoint(bound=1.0, summands=4)
    fraction, draws = 0.3, 200_000
    value = (12345 + fraction) / codec.scale

    # Execute
    encoded = codec.encode(np.full(draws, value), np.random.default_rng(7))
    errors = encoded.view(np.int32).astype(np.float64) - value * codec.scale

    # Assert: mean error within 6 standard errors of 0 (a Bernoulli(0.3) rounding per draw)
    standard_error = math.sqrt(fraction * (1 - fraction) / draws)
    assert abs(errors.mean()) < 6 * standard_error
    assert 6 * standard_error < fraction / 10
    assert set(np.unique(encoded)) == {12345, 12346}


def test_values_outside_the_bound_are_clipped():
    codec = FixedPoint(bound=2.0, summands=3)
    encoded = codec.encode(np.array([10.0, -1e9, np.inf, 1.5]), np.random.default_rng(1))
    np.testing.assert_allclose(codec.decode_sum(encoded), [2.0, -2.0, 2.0, 1.5], atol=1 / codec.scale)


def test_negative_values_are_twos_complement():
    codec = FixedPoint(bound=1.0, summands=1)
    encoded = codec.encode(np.array([-1.0]), np.random.default_rng(0))
    assert encoded.dtype == np.uint32 and int(encoded[0]) == 2**32 - codec.scale


@pytest.mark.parametrize(("bound", "summands", "field"), [
    (0.0, 1, "bound"), (-1.0, 1, "bound"), (math.nan, 1, "bound"), (1.0, 0, "summands"), (1e10, 1, "scale"),
])
def test_bad_parameters_are_rejected(bound, summands, field):
    with pytest.raises(SecAggError, match=field):
        FixedPoint(bound, summands)


def test_nan_values_and_wrong_totals_are_rejected():
    codec = FixedPoint(1.0, 2)
    with pytest.raises(SecAggError, match="finite"):
        codec.encode(np.array([np.nan]), np.random.default_rng(0))
    with pytest.raises(SecAggError, match="uint32"):
        codec.decode_sum(np.zeros(3, dtype=np.int64))
