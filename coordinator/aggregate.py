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


def weighted_mean(updates: Iterable[tuple[Mapping[str, np.ndarray], float]]) -> ArrayGroup:
    """The weighted mean of (arrays, weight) pairs, by name."""
    mean = WeightedMean()
    for arrays, weight in updates:
        mean.add(arrays, weight)
    return mean.result()
