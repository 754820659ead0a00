"""Robust aggregation: coordinate-wise median, trimmed mean and norm clipping of updates.

The plain example-weighted mean (`averaging.WeightedMean`) streams and holds one model; the
robust rules need every update of the round at once, so they hold one model per reply and are
exempt from the coordinator's memory bound (about 2.5 models whatever the fleet, docs/DEPLOYING.md).
Clipping wraps any rule: each update's change from the broadcast state is scaled down to
`clip_norm`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from edge_sdk.params import aligned_reference, blocks, flat
from edge_sdk.protocol import ArrayGroup
from edge_sdk.settings import DEFINES, DEFINES_IF_SET, setting

from .averaging import WeightedMean, squared_distance

AGGREGATIONS = ("mean", "median", "trimmed_mean")
SUM_DTYPES = ("float32", "float64")


class Aggregator(Protocol):
    def add(self, arrays: Mapping[str, np.ndarray], weight: float) -> None: ...
    def result(self) -> ArrayGroup: ...


@dataclass(frozen=True)
class AggregationSettings:
    """How the coordinator combines a round's updates: the `[aggregation]` section of a run."""

    rule: str = setting("mean", key="aggregation", defines=DEFINES,
                        help="mean | median | trimmed_mean (robust rules hold every update of a round)")
    trim_fraction: float = setting(0.2, defines=DEFINES,
                                   help="share of the largest and of the smallest values dropped by trimmed_mean")
    clip_norm: float = setting(0.0, defines=DEFINES,
                               help="clip each update's change to this L2 norm before aggregating (0: off)")
    dtype: str = setting("float32", key="aggregation_dtype", defines=DEFINES_IF_SET,
                         help="float32 | float64: what the mean sums updates in (float64: one more model of memory; "
                              "runs then repeat bit for bit whatever order updates arrive in, and are other runs "
                              "than float32 ones: a resume needs the same)")

    def __post_init__(self) -> None:
        if self.rule not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {self.rule!r}")
        if not 0 <= self.trim_fraction < 0.5:
            raise ValueError(f"trim_fraction must be in [0, 0.5), got {self.trim_fraction}")
        if self.clip_norm < 0:
            raise ValueError(f"clip_norm must be zero (off) or positive, got {self.clip_norm}")
        if self.dtype not in SUM_DTYPES:
            raise ValueError(f"aggregation_dtype must be one of {', '.join(SUM_DTYPES)}, got {self.dtype!r}")


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
    """Scales each update's change from `reference` to at most `clip_norm` (L2 over all arrays).

    The norm is taken a block at a time; only an update that is clipped is copied."""

    def __init__(self, inner: Aggregator, reference: Mapping[str, np.ndarray], clip_norm: float):
        self.inner, self.reference, self.clip_norm = inner, reference, clip_norm
        self.clipped = 0

    def add(self, arrays: Mapping[str, np.ndarray], weight: float) -> None:
        references = {k: aligned_reference(np.asarray(self.reference[k]), np.asarray(v)) for k, v in arrays.items()}
        norm = math.sqrt(sum(squared_distance(v, references[k]) for k, v in arrays.items()))
        if norm <= self.clip_norm:
            self.inner.add(arrays, weight)
            return
        self.clipped += 1
        scale = self.clip_norm / norm
        self.inner.add({k: _toward(np.asarray(v), references[k], scale) for k, v in arrays.items()}, weight)

    def result(self) -> ArrayGroup:
        return self.inner.result()


def _toward(value: np.ndarray, reference: np.ndarray | None, scale: float) -> np.ndarray:
    """reference + scale * (value - reference) in value's dtype (computed in float64, by blocks)."""
    out = np.empty(value.shape, value.dtype)
    flat_out, flat_value, flat_reference = out.reshape(-1), flat(value), flat(reference)
    for part in blocks(flat_value.size):
        base = 0.0 if flat_reference is None else flat_reference[part].astype(np.float64)
        flat_out[part] = base + scale * (flat_value[part] - base)
    return out


def make_aggregator(settings: AggregationSettings, reference: Mapping[str, np.ndarray] | None = None) -> Aggregator:
    """The round's aggregator for `settings`; `reference` (the broadcast arrays) for clipping."""
    rule: Aggregator
    if settings.rule == "median":
        rule = CoordinateMedian()
    elif settings.rule == "trimmed_mean":
        rule = TrimmedMean(settings.trim_fraction)
    else:
        rule = WeightedMean(reference, settings.dtype)
    if settings.clip_norm > 0:
        if reference is None:
            raise ValueError("clipping needs the broadcast state as reference")
        return Clipped(rule, reference, settings.clip_norm)
    return rule
