"""Pure aggregation math over named arrays: streaming weighted means and class statistics.

Aggregation is by parameter name and streaming: an update is folded into the running sum as
it arrives, so the coordinator holds one accumulator, not one model per device.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np

from edge_sdk.protocol import ArrayGroup


class WeightedMean:
    """Running weighted mean of named arrays (float64 accumulators, results in the input dtype)."""

    def __init__(self) -> None:
        self._sums: dict[str, np.ndarray] = {}
        self._dtypes: dict[str, np.dtype] = {}
        self.total_weight = 0.0
        self.count = 0

    def add(self, arrays: Mapping[str, np.ndarray], weight: float) -> None:
        if weight <= 0 or not np.isfinite(weight):
            raise ValueError(f"weight must be positive and finite, got {weight}")
        if self._sums and set(arrays) != set(self._sums):
            raise ValueError("every update must carry the same array names")
        for key, value in arrays.items():
            if key in self._sums and np.shape(value) != self._sums[key].shape:
                raise ValueError(f"{key}: shape {np.shape(value)} differs from {self._sums[key].shape}")
        for key, value in arrays.items():
            if key not in self._sums:
                self._sums[key] = np.zeros(value.shape, dtype=np.float64)
                self._dtypes[key] = value.dtype
            self._sums[key] += weight * value
        self.total_weight += weight
        self.count += 1

    def result(self) -> ArrayGroup:
        if self.count == 0:
            raise ValueError("no update was added")
        return {k: (s / self.total_weight).astype(self._dtypes[k]) for k, s in self._sums.items()}


def aligned_reference(base: np.ndarray, value: np.ndarray) -> np.ndarray | None:
    """`base` cut to `value`'s shape when `value` is a leading slice of it (as CD2-pFed's shared
    entries are of the previous round's), `base` itself for equal shapes, else None."""
    if base.shape == value.shape:
        return base
    if base.ndim == value.ndim and all(v <= b for v, b in zip(value.shape, base.shape)):
        return base[tuple(slice(0, s) for s in value.shape)]
    return None


def weighted_mean(updates: Iterable[tuple[Mapping[str, np.ndarray], float]]) -> ArrayGroup:
    """The weighted mean of (arrays, weight) pairs, by name."""
    mean = WeightedMean()
    for arrays, weight in updates:
        mean.add(arrays, weight)
    return mean.result()


def pool_class_stats(stats: Iterable[tuple[int, np.ndarray, np.ndarray]]) -> tuple[int, np.ndarray, np.ndarray]:
    """Pooled count, mean and unbiased covariance of one class over several clients (DC-PFL).

    `stats` holds each client's `(n_k, mean_k [d], cov_k [d, d])` with `cov_k` unbiased (divided
    by n_k - 1; ignored where n_k < 2). The result is exactly that of the concatenated features,
    DC-PFL Eq. (10)-(11): mean = sum n_k mean_k / N and
    (N - 1) cov = sum_k [(n_k - 1) cov_k + n_k (mean_k - mean)(mean_k - mean)^T]
    (the centred form of Eq. 11, the same value with less cancellation). Computed in float64.
    A class seen by no client pools to (0, zeros, zeros); one seen once has a zero covariance.
    """
    items = [(int(n), np.asarray(m, dtype=np.float64), np.asarray(c, dtype=np.float64)) for n, m, c in stats]
    if not items:
        raise ValueError("pool_class_stats needs at least one (count, mean, cov)")
    if any(n < 0 for n, _, _ in items):
        raise ValueError("counts must be non-negative")
    dim = items[0][1].shape[0]
    total = sum(n for n, _, _ in items)
    mean, cov = np.zeros(dim), np.zeros((dim, dim))
    if total == 0:
        return 0, mean, cov
    for n, m, _ in items:
        mean += n * m
    mean /= total
    if total < 2:
        return total, mean, cov
    for n, m, c in items:
        if n == 0:
            continue
        delta = m - mean
        cov += n * np.outer(delta, delta)
        if n >= 2:
            cov += (n - 1) * c
    return total, mean, cov / (total - 1)
