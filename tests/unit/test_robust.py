"""Robust aggregation rules on hand-checkable numbers, and the attacks used to exercise them."""

from __future__ import annotations

import numpy as np
import pytest

from edge_sdk.params import aligned_reference
from coordinator.aggregation.averaging import WeightedMean
from coordinator.aggregation.robust import AggregationSettings, Clipped, CoordinateMedian, TrimmedMean, make_aggregator
from edge_sdk.attacks import corrupt
from edge_sdk.protocol import ArrayGroup


def updates(*values):
    return [{"w": np.array(v, dtype=np.float32)} for v in values]


def test_coordinate_median_ignores_one_outlier_per_coordinate():
    median = CoordinateMedian()
    for update in updates([1, 10], [2, 20], [1000, -1000]):
        median.add(update, weight=1.0)

    result = median.result()

    np.testing.assert_array_equal(result["w"], np.array([2, 10], dtype=np.float32))
    assert result["w"].dtype == np.float32


def test_trimmed_mean_drops_the_extremes_of_each_coordinate():
    trimmed = TrimmedMean(fraction=0.2)  # 5 updates: one dropped at each end
    for update in updates([1, 5], [2, 4], [3, 3], [4, 2], [100, -100]):
        trimmed.add(update, weight=1.0)

    result = trimmed.result()

    np.testing.assert_allclose(result["w"], [3.0, 3.0])


def test_clipping_scales_a_large_change_to_the_bound():
    reference = {"w": np.zeros(2)}
    clipped = Clipped(WeightedMean(), reference, clip_norm=1.0)

    clipped.add({"w": np.array([3.0, 4.0], dtype=np.float32)}, weight=1.0)  # norm 5 -> 1
    clipped.add({"w": np.array([0.3, 0.4], dtype=np.float32)}, weight=1.0)  # norm 0.5: kept

    np.testing.assert_allclose(clipped.result()["w"], [(0.6 + 0.3) / 2, (0.8 + 0.4) / 2], rtol=1e-6)
    assert clipped.clipped == 1


def test_make_aggregator_picks_the_rule_and_wraps_clipping():
    assert isinstance(make_aggregator(AggregationSettings("median")), CoordinateMedian)
    assert isinstance(make_aggregator(AggregationSettings("mean")), WeightedMean)
    assert isinstance(make_aggregator(AggregationSettings("mean", clip_norm=2.0), {"w": np.zeros(1)}), Clipped)
    with pytest.raises(ValueError, match="aggregation"):
        AggregationSettings("mode")
    with pytest.raises(ValueError, match="trim_fraction"):
        AggregationSettings("trimmed_mean", trim_fraction=0.5)
    with pytest.raises(ValueError, match="aggregation_dtype"):
        AggregationSettings("mean", dtype="float16")


def test_aligned_reference_cuts_the_previous_slice():
    base = np.arange(12.0).reshape(4, 3)

    reference = aligned_reference(base, np.zeros((2, 3)))
    assert reference is not None and reference.shape == (2, 3)
    assert aligned_reference(base, np.zeros((5, 3))) is None


def test_attacks_corrupt_floating_arrays_only():
    down = {"shared": {"w": np.ones(3, dtype=np.float32)}}
    up: dict[str, ArrayGroup] = {"shared": {"w": np.full(3, 1.5, dtype=np.float32), "n": np.array([7], dtype=np.int64)}}
    rng = np.random.default_rng(0)

    flipped = corrupt("sign_flip", up, down, rng)
    nan = corrupt("nan", up, down, rng)
    noisy = corrupt("noise", up, down, rng)

    np.testing.assert_allclose(flipped["shared"]["w"], 1 - 10 * 0.5)
    assert np.isnan(nan["shared"]["w"]).all() and nan["shared"]["n"][0] == 7
    assert not np.allclose(noisy["shared"]["w"], 1.5)
