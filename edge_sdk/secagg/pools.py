"""The release phase's pools as vectors for the secure sum: a trainer's BatchNorm statistics of
the global body, and a weak device's class prototypes.

Both pools are weighted means, so each device sends the terms of a numerator and a denominator
and the coordinator divides their sums, as it does for a round's updates (vector.py). A device's
weight is scaled by the stage's `largest` (the largest count among the devices asked), so that
every weight is at most 1, and every value is clipped to [-bound, bound] first: each coordinate
of a device's vector is then within the bound the fixed point (fixedpoint.py) is sized for.

- Statistics: w = examples / largest; per floating buffer in name order, w x running_mean and
  w x (running_var + running_mean^2) (E[x^2], so that the pooled variance is E[x^2] - E[x]^2 over
  the union of the data, as the plain pool computes it), then w. `num_batches_tracked` (unused in
  inference) does not enter the sum: the pooled one is 0.
- Prototypes: per class c, w_c = count_c / largest, then w_c x mean_c (class-major); the pooled
  counts are the summed weights times `largest`, rounded, and the pooled means the summed terms
  over the summed weights.

The coordinator cannot check one device's share under secure aggregation (shapes, finiteness,
plausible counts): the device checks its own before it encodes it, and the clip bounds what a
device can move the pooled result by.
"""

from __future__ import annotations

import math

import numpy as np

from ..protocol import ArrayGroup

COUNT_SUFFIX, MEAN_SUFFIX, VAR_SUFFIX = "num_batches_tracked", "running_mean", "running_var"


def _check_finite(name: str, value: np.ndarray) -> None:
    if not np.all(np.isfinite(value)):
        raise ValueError(f"{name} is not finite")


def _weight(count: float, largest: int) -> float:
    if largest < 1 or not 0 <= count <= largest:
        raise ValueError(f"a count of {count} with the stage's largest {largest}: the weight must be in [0, 1]")
    return count / largest


def statistics_keys(shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The floating buffers that enter the sum, in its order (batch counters stay out)."""
    return sorted(key for key in shapes if not key.endswith(COUNT_SUFFIX))


def statistics_length(shapes: dict[str, tuple[int, ...]]) -> int:
    """Elements of a statistics vector: every floating buffer, and the weight last."""
    return sum(math.prod(shapes[key]) for key in statistics_keys(shapes)) + 1


def encode_statistics(arrays: ArrayGroup, examples: int, largest: int, bound: float) -> np.ndarray:
    """A trainer's BatchNorm statistics as its terms of the pooled mean (float64)."""
    weight = _weight(examples, largest)
    parts = []
    for key in statistics_keys({k: v.shape for k, v in arrays.items()}):
        value = np.asarray(arrays[key], dtype=np.float64)
        _check_finite(key, value)
        if key.endswith(VAR_SUFFIX):
            mean = arrays.get(key[:-len(VAR_SUFFIX)] + MEAN_SUFFIX)
            if mean is None or (value < 0).any():
                raise ValueError(f"{key}: a variance needs its mean beside it and must not be negative")
            value = value + np.asarray(mean, dtype=np.float64) ** 2
        parts.append(weight * np.clip(value.ravel(), -bound, bound))
    return np.concatenate([*parts, [weight]])


def decode_statistics(total: np.ndarray, shapes: dict[str, tuple[int, ...]]) -> ArrayGroup:
    """The pooled statistics (float32 means and variances; counters 0) from a summed vector."""
    if total.shape != (statistics_length(shapes),):
        raise ValueError(f"a statistics sum has {statistics_length(shapes)} elements, got shape {total.shape}")
    weight = float(total[-1])
    if weight <= 0:
        raise ValueError("no statistics were pooled (total weight 0)")
    moments: dict[str, np.ndarray] = {}
    start = 0
    for key in statistics_keys(shapes):
        stop = start + math.prod(shapes[key])
        moments[key] = total[start:stop].reshape(shapes[key]) / weight
        start = stop
    pooled: ArrayGroup = {key: np.zeros(shape, dtype=np.int64) for key, shape in shapes.items()
                          if key.endswith(COUNT_SUFFIX)}
    for key, value in moments.items():
        if key.endswith(VAR_SUFFIX):
            mean = moments[key[:-len(VAR_SUFFIX)] + MEAN_SUFFIX]
            value = np.maximum(value - mean ** 2, 0.0)
        pooled[key] = value.astype(np.float32)
    return pooled


def prototypes_length(num_classes: int, dim: int) -> int:
    """Elements of a prototypes vector: a weight and a mean per class."""
    return num_classes * (dim + 1)


def encode_prototypes(counts: np.ndarray, means: np.ndarray, largest: int, bound: float) -> np.ndarray:
    """A weak device's class counts [C] and feature means [C, d] as its terms of the pooled means."""
    counts = np.asarray(counts)
    means = np.asarray(means, dtype=np.float64)
    if counts.ndim != 1 or means.ndim != 2 or means.shape[0] != counts.shape[0]:
        raise ValueError(f"prototypes: counts {list(counts.shape)} and means {list(means.shape)} do not match")
    _check_finite("the prototype means", means)
    if (counts < 0).any() or int(counts.sum()) > largest:
        raise ValueError(f"class counts sum to {int(counts.sum())}, above the stage's largest {largest}")
    weights = counts.astype(np.float64) / largest
    terms = weights[:, None] * np.clip(means, -bound, bound)
    return np.concatenate([weights, terms.ravel()])


def decode_prototypes(total: np.ndarray, num_classes: int, dim: int, largest: int) -> ArrayGroup:
    """The pooled prototypes (int64 counts, float32 means; 0 for a class nobody holds)."""
    if total.shape != (prototypes_length(num_classes, dim),):
        raise ValueError(f"a prototypes sum has {prototypes_length(num_classes, dim)} elements, got {total.shape}")
    weights = total[:num_classes]
    sums = total[num_classes:].reshape(num_classes, dim)
    counts = np.maximum(np.rint(weights * largest), 0).astype(np.int64)
    held = counts > 0
    means = np.zeros((num_classes, dim))
    means[held] = sums[held] / weights[held, None]
    return {"counts": counts, "means": means.astype(np.float32)}
