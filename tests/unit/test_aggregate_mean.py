"""Unit tests for the weighted mean in coordinator.aggregate (hand-checkable numbers)."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.aggregate import WeightedMean, weighted_mean


def test_weighted_mean_of_two_updates_with_weights_1_and_3():
    # Prepare
    a = {"w": np.array([1.0, 2.0], np.float32), "b": np.array([[0.0]], np.float32)}
    b = {"w": np.array([5.0, 10.0], np.float32), "b": np.array([[4.0]], np.float32)}

    # Execute
    mean = weighted_mean([(a, 1.0), (b, 3.0)])

    # Assert: (1*1 + 3*5)/4 = 4, (1*2 + 3*10)/4 = 8, (0 + 12)/4 = 3
    np.testing.assert_array_equal(mean["w"], np.array([4.0, 8.0], np.float32))
    np.testing.assert_array_equal(mean["b"], np.array([[3.0]], np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_result_keeps_the_input_dtype(dtype):
    # Prepare
    updates = [({"w": np.array([1.0, 3.0], dtype)}, 2.0), ({"w": np.array([3.0, 5.0], dtype)}, 2.0)]

    # Execute
    mean = weighted_mean(updates)

    # Assert
    assert mean["w"].dtype == dtype
    np.testing.assert_array_equal(mean["w"], np.array([2.0, 4.0], dtype))


def test_streaming_equals_batch_and_numpy_average():
    # Prepare
    rng = np.random.default_rng(42)
    updates = [({"w": rng.standard_normal((3, 4)), "v": rng.standard_normal(5)}, float(rng.integers(1, 100)))
               for _ in range(6)]

    # Execute
    streaming = WeightedMean()
    for arrays, weight in updates:
        streaming.add(arrays, weight)
    streamed = streaming.result()
    batch = weighted_mean(updates)

    # Assert
    weights = [w for _, w in updates]
    for key in ("w", "v"):
        np.testing.assert_array_equal(streamed[key], batch[key])
        expected = np.average(np.stack([a[key] for a, _ in updates]), axis=0, weights=weights)
        np.testing.assert_allclose(streamed[key], expected, rtol=1e-12)
    assert streaming.count == 6 and streaming.total_weight == sum(weights)


def test_float32_updates_are_accumulated_in_float64():
    # Prepare: in float32, 2**24 + 1 == 2**24, so float32 sums would lose both ones
    big = np.array([16777216.0], np.float32)  # 2**24
    one = np.array([1.0], np.float32)
    mean = WeightedMean()

    # Execute
    mean.add({"w": big}, 1.0)
    mean.add({"w": one}, 1.0)
    mean.add({"w": one}, 1.0)

    # Assert: (16777216 + 2) / 3 = 5592406.0 exactly (float32 sums would give 5592405.5)
    assert mean.result()["w"][0] == np.float32(5592406.0)


@pytest.mark.parametrize("weight", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_weight_raises_and_changes_nothing(weight):
    # Prepare
    mean = WeightedMean()
    mean.add({"w": np.array([2.0])}, 1.0)

    # Execute / Assert
    with pytest.raises(ValueError, match="weight"):
        mean.add({"w": np.array([100.0])}, weight)
    assert mean.count == 1 and mean.total_weight == 1.0
    np.testing.assert_array_equal(mean.result()["w"], [2.0])


@pytest.mark.parametrize("names", [{"w", "extra"}, {"other"}, set()], ids=["extra", "renamed", "none"])
def test_mismatched_names_raise(names):
    # Prepare
    mean = WeightedMean()
    mean.add({"w": np.zeros(2)}, 1.0)

    # Execute / Assert
    with pytest.raises(ValueError, match="names"):
        mean.add({k: np.zeros(2) for k in names}, 1.0)


@pytest.mark.parametrize("shape", [(1,), (), (2, 3)], ids=["broadcast-1", "scalar", "2-d"])
def test_mismatched_shapes_raise(shape):
    # Prepare
    mean = WeightedMean()
    mean.add({"w": np.zeros(3)}, 1.0)

    # Execute / Assert: a shape that numpy would broadcast must not be averaged in silently
    with pytest.raises(ValueError):
        mean.add({"w": np.ones(shape)}, 1.0)


def test_result_without_updates_raises():
    with pytest.raises(ValueError):
        WeightedMean().result()
    with pytest.raises(ValueError):
        weighted_mean([])
