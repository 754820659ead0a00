"""Robust aggregation: coordinate-wise median, trimmed mean and norm clipping of updates.

The plain example-weighted mean (`aggregate.WeightedMean`) streams and holds one model; the
robust rules need every update of the round at once, so they hold one model per reply. Clipping
wraps any rule: each update's change from the broadcast state is scaled down to `clip_norm`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Protocol

import numpy as np

from edge_sdk.protocol import ArrayGroup

from .aggregate import WeightedMean, aligned_reference

AGGREGATIONS = ("mean", "median", "trimmed_mean")


class Aggregator(Protocol):
    def add(self, arrays: Mapping[str, np.ndarray], weight: float) -> None: ...
    def result(self) -> ArrayGroup: ...


@dataclass(frozen=True)
class AggregationSettings:
    rule: str = "mean"
    trim_fraction: float = 0.2
    clip_norm: float = 0.0  # 0: no clipping

    def __post_init__(self) -> None:
        if self.rule not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {self.rule!r}")
        if not 0 <= self.trim_fraction < 0.5:
            raise ValueError(f"trim_fraction must be in [0, 0.5), got {self.trim_fraction}")
        if self.clip_norm < 0:
            raise ValueError(f"clip_norm must be zero (off) or positive, got {self.clip_norm}")


class _Collected:
    """Keeps every update of the round (robust rules are not streaming)."""

    def __init__(self) -> None:
        self.updates: list[Mapping[str, np.ndarray]] = []

    def add(self, arrays: Mapping[str, np.ndarray], weight: float) -> None:
        if self.updates and set(arrays) != set(self.updates[0]):
            raise ValueError("every update must carry the same array names")
        self.updates.append(arrays)

    def _stack(self, key: str) -> np.ndarray:
        return np.stack([np.asarray(u[key], dtype=np.float64) for u in self.updates])

    def _result(self, reduce) -> ArrayGroup:
        if not self.updates:
            raise ValueError("no update was added")
        first = self.updates[0]
        return {k: reduce(self._stack(k)).astype(first[k].dtype) for k in first}


class CoordinateMedian(_Collected):
    """The median of every coordinate over the round's updates (weights are not used)."""

    def result(self) -> ArrayGroup:
        return self._result(lambda stacked: np.median(stacked, axis=0))


class TrimmedMean(_Collected):
    """Per coordinate, drop the `fraction` largest and smallest values, average the rest."""

    def __init__(self, fraction: float):
        super().__init__()
        self.fraction = fraction

    def result(self) -> ArrayGroup:
        def reduce(stacked: np.ndarray) -> np.ndarray:
            n = stacked.shape[0]
            cut = min(int(math.floor(self.fraction * n)), (n - 1) // 2)
            ordered = np.sort(stacked, axis=0)
            return ordered[cut : n - cut].mean(axis=0)

        return self._result(reduce)


class Clipped:
    """Scales each update's change from `reference` to at most `clip_norm` (L2 over all arrays)."""

    def __init__(self, inner: Aggregator, reference: Mapping[str, np.ndarray], clip_norm: float):
        self.inner, self.reference, self.clip_norm = inner, reference, clip_norm
        self.clipped = 0

    def add(self, arrays: Mapping[str, np.ndarray], weight: float) -> None:
        deltas = {k: np.asarray(v, np.float64) - aligned_reference(self.reference[k], np.asarray(v))
                  for k, v in arrays.items()}
        norm = math.sqrt(sum(float(np.vdot(d, d)) for d in deltas.values()))
        if norm <= self.clip_norm:
            self.inner.add(arrays, weight)
            return
        self.clipped += 1
        scale = self.clip_norm / norm
        self.inner.add({k: (arrays[k] - (1 - scale) * d).astype(arrays[k].dtype) for k, d in deltas.items()},
                       weight)

    def result(self) -> ArrayGroup:
        return self.inner.result()


def make_aggregator(settings: AggregationSettings, reference: Mapping[str, np.ndarray] | None = None) -> Aggregator:
    """The round's aggregator for `settings`; `reference` (the broadcast arrays) for clipping."""
    rule: Aggregator
    if settings.rule == "median":
        rule = CoordinateMedian()
    elif settings.rule == "trimmed_mean":
        rule = TrimmedMean(settings.trim_fraction)
    else:
        rule = WeightedMean()
    if settings.clip_norm > 0:
        if reference is None:
            raise ValueError("clipping needs the broadcast state as reference")
        return Clipped(rule, {k: np.asarray(v, np.float64) for k, v in reference.items()}, settings.clip_norm)
    return rule
