"""Unit tests for the weighted mean in coordinator.aggregation.averaging (hand-checkable numbers)."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.aggregation.averaging import WeightedMean, weighted_mean


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


def test_float32_changes_from_the_reference_are_summed_exactly():
    # Prepare: in float32, 2**24 + 1 == 2**24, so plain float32 sums would lose both ones; summed
    # as changes from the broadcast value 2**24 they are exact
    big = np.array([16777216.0], np.float32)  # 2**24
    one = np.array([1.0], np.float32)
    mean = WeightedMean(reference={"w": big})

    # Execute
    mean.add({"w": big}, 1.0)
    mean.add({"w": one}, 1.0)
    mean.add({"w": one}, 1.0)

    # Assert: (16777216 + 2) / 3 = 5592406.0 exactly (float32 sums without the reference: 5592405.5)
    assert mean.result()["w"][0] == np.float32(5592406.0)


def test_streaming_float32_mean_of_a_thousand_updates_equals_the_batch_mean():
    # Prepare: 1,000 updates near a broadcast state, arrays larger than one accumulation block
    rng = np.random.default_rng(7)
    reference = {"w": rng.standard_normal(70_000).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}
    updates = [({k: (v + 0.01 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in reference.items()},
                float(rng.integers(1, 500))) for _ in range(1000)]

    # Execute
    mean = WeightedMean(reference)
    for arrays, weight in updates:
        mean.add(arrays, weight)
    result = mean.result()

    # Assert: equal to the float64 batch mean to float32 precision, as float32, without a float64 copy
    weights = [w for _, w in updates]
    for key in ("w", "b"):
        expected = sum(w * a[key].astype(np.float64) for a, w in updates) / sum(weights)
        assert result[key].dtype == np.float32
        np.testing.assert_allclose(result[key], expected, rtol=0, atol=2e-6)
    assert mean.count == 1000 and mean.total_weight == sum(weights)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_only_float64_sums_are_independent_of_the_order_updates_arrive_in(dtype):
    # Prepare: the same 50 float32 updates in two orders
    rng = np.random.default_rng(3)
    reference = {"w": rng.standard_normal(20_000).astype(np.float32)}
    updates = [({"w": (reference["w"] + 0.1 * rng.standard_normal(20_000)).astype(np.float32)},
                float(rng.integers(1, 500))) for _ in range(50)]

    # Execute
    means = []
    for order in (updates, updates[::-1]):
        mean = WeightedMean(reference, dtype)
        for arrays, weight in order:
            mean.add(arrays, weight)
        means.append(mean.result()["w"])

    # Assert: float32 in both cases; bit for bit only with float64 sums
    assert means[0].dtype == means[1].dtype == np.float32
    np.testing.assert_allclose(means[0], means[1], rtol=0, atol=1e-6)
    assert np.array_equal(means[0], means[1]) == (dtype == "float64")


def test_the_result_is_the_accumulator_and_the_mean_is_spent():
    # Prepare
    mean = WeightedMean()
    mean.add({"w": np.array([1.0, 2.0], np.float32)}, 1.0)

    # Execute
    first, second = mean.result(), mean.result()

    # Assert: taken once, in place; adding afterwards would change a handed-out state
    assert first["w"] is second["w"]
    with pytest.raises(ValueError, match="already taken"):
        mean.add({"w": np.array([5.0, 5.0], np.float32)}, 1.0)
    np.testing.assert_array_equal(first["w"], [1.0, 2.0])


def test_integer_arrays_are_averaged_in_float64_and_keep_their_dtype():
    # Prepare: a counter like BatchNorm's num_batches_tracked
    mean = WeightedMean(reference={"n": np.array(10, np.int64)})

    # Execute
    mean.add({"n": np.array(11, np.int64)}, 1.0)
    mean.add({"n": np.array(14, np.int64)}, 3.0)

    # Assert: 10 + (1 * 1 + 3 * 4) / 4 = 13.25, cast back to int64
    assert mean.result()["n"].dtype == np.int64 and int(mean.result()["n"]) == 13


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
