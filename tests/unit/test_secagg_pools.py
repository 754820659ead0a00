"""The release pools under secure aggregation (edge_sdk/secagg/pools.py): devices' shares encoded,
quantized into the ring and summed there give the plain pool's result within the quantization
error; a share that must not go up is refused on the device, and values beyond the bound are
clipped."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.releases.phase import PrototypePool, StatisticsPool
from edge_sdk.secagg.fixedpoint import FixedPoint
from edge_sdk.secagg.pools import (decode_prototypes, decode_statistics, encode_prototypes, encode_statistics,
                                   prototypes_length, statistics_length)

BOUND = 1000.0


def ring_sum(vectors: list[np.ndarray], bound: float, seed: int = 0) -> np.ndarray:
    """The vectors quantized as the devices do and summed mod 2^32, decoded as the coordinator does."""
    quantizer = FixedPoint(max(bound, 1.0), len(vectors))
    rng = np.random.default_rng(seed)
    total = np.zeros(len(vectors[0]), dtype=np.uint32)
    for vector in vectors:
        total += quantizer.encode(vector, rng)
    return quantizer.decode_sum(total)


def device_statistics(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"body.bn1.running_mean": rng.normal(0, 3, 8).astype(np.float32),
            "body.bn1.running_var": rng.gamma(2.0, 2.0, 8).astype(np.float32),
            "body.bn1.num_batches_tracked": np.array(int(rng.integers(10, 50))),
            "body.bn2.running_mean": rng.normal(1, 0.5, (4,)).astype(np.float32),
            "body.bn2.running_var": rng.gamma(1.0, 0.5, (4,)).astype(np.float32)}


@pytest.mark.parametrize("devices, seed", [(3, 0), (7, 1), (25, 2)])
def test_statistics_summed_in_the_ring_are_the_plain_pool_s(devices, seed):
    # Prepare
    rng = np.random.default_rng(seed)
    shares = [device_statistics(rng) for _ in range(devices)]
    examples = [int(rng.integers(20, 400)) for _ in range(devices)]
    largest = max(examples)
    shapes = {key: value.shape for key, value in shares[0].items()}
    plain = StatisticsPool(shapes)
    for share, count in zip(shares, examples, strict=True):
        plain.add(share, count)

    # Execute
    encoded = [encode_statistics(s, n, largest, BOUND) for s, n in zip(shares, examples, strict=True)]
    total = ring_sum(encoded, BOUND, seed)
    secure = StatisticsPool(shapes)
    secure.add_sum(total, devices, largest)

    # Assert: the pooled means and variances within the rounding (under n / scale of the total
    # weight); the unused batch counters are 0
    expected, actual = plain.result(), secure.result()
    assert set(actual) == set(expected) and secure.devices == devices
    for key, value in expected.items():
        if key.endswith("num_batches_tracked"):
            assert actual[key] == 0
        else:
            assert np.allclose(actual[key], value, atol=1e-3), key
    assert len(encode_statistics(shares[0], examples[0], largest, BOUND)) == statistics_length(shapes)


@pytest.mark.parametrize("devices, seed", [(3, 0), (9, 3)])
def test_prototypes_summed_in_the_ring_are_the_plain_pool_s_with_exact_counts(devices, seed):
    # Prepare: ten classes, some held by nobody
    rng = np.random.default_rng(seed)
    classes, dim = 10, 6
    counts = [np.where(rng.random(classes) < 0.6, rng.integers(0, 60, classes), 0) for _ in range(devices)]
    for c in counts:
        c[9] = 0
    means = [rng.normal(0, 5, (classes, dim)).astype(np.float32) for _ in range(devices)]
    largest = max(int(c.sum()) for c in counts) + 5
    plain = PrototypePool(classes, dim)
    for c, m in zip(counts, means, strict=True):
        plain.add({"counts": c, "means": m}, int(c.sum()))

    # Execute
    total = ring_sum([encode_prototypes(c, m, largest, BOUND) for c, m in zip(counts, means, strict=True)], BOUND, seed)
    secure = PrototypePool(classes, dim)
    secure.add_sum(total, devices, largest)

    # Assert
    expected, actual = plain.result(), secure.result()
    assert np.array_equal(actual["counts"], expected["counts"]) and actual["counts"][9] == 0
    assert np.allclose(actual["means"], expected["means"], atol=1e-3)
    assert not actual["means"][9].any()
    assert total.shape == (prototypes_length(classes, dim),)


def test_values_beyond_the_bound_are_clipped_before_they_enter_the_sum():
    counts = np.array([4, 0, 2])
    means = np.array([[5000.0, 1.0], [0.0, 0.0], [-3.0, -7000.0]])

    pooled = decode_prototypes(encode_prototypes(counts, means, 10, BOUND), 3, 2, 10)

    assert np.allclose(pooled["means"], [[BOUND, 1.0], [0.0, 0.0], [-3.0, -BOUND]])
    assert pooled["counts"].tolist() == [4, 0, 2]


@pytest.mark.parametrize("share, why", [
    ({"counts": np.array([3, 1]), "means": np.array([[np.nan], [0.0]]), "largest": 10}, "not finite"),
    ({"counts": np.array([8, 7]), "means": np.zeros((2, 1)), "largest": 10}, "above the stage's largest"),
    ({"counts": np.array([-1, 2]), "means": np.zeros((2, 1)), "largest": 10}, "above the stage's largest"),
])
def test_a_prototype_share_that_must_not_go_up_is_refused_on_the_device(share, why):
    with pytest.raises(ValueError, match=why):
        encode_prototypes(share["counts"], share["means"], share["largest"], BOUND)


def test_statistics_with_a_negative_variance_or_too_many_examples_are_refused_on_the_device():
    good = device_statistics(np.random.default_rng(0))
    bad = {**good, "body.bn2.running_var": -np.ones(4, dtype=np.float32)}
    with pytest.raises(ValueError, match="must not be negative"):
        encode_statistics(bad, 10, 10, BOUND)
    with pytest.raises(ValueError, match="weight must be in"):
        encode_statistics(good, 11, 10, BOUND)


def test_a_sum_of_the_wrong_length_is_refused():
    shapes: dict[str, tuple[int, ...]] = {"body.bn.running_mean": (3,), "body.bn.running_var": (3,)}
    with pytest.raises(ValueError, match="7 elements"):
        decode_statistics(np.zeros(6), shapes)
