"""Pure aggregation math over named arrays: streaming weighted means and class statistics.

Aggregation is by parameter name and streaming: an update is folded into the running sum as
it arrives and can be dropped right away, so the coordinator holds one accumulator the size of
one model, not one model per device, and no full-size temporaries.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from edge_sdk.params import BLOCK, aligned_reference, blocks, flat
from edge_sdk.protocol import ArrayGroup


def accumulator_dtype(dtype: np.dtype, least: np.dtype = np.dtype(np.float32)) -> np.dtype:
    """What an array of `dtype` is summed in: `least`, or wider where the input needs it
    (float64, int64, int32).

    With `least` float32, float32 updates are summed in float32, keeping the accumulator the
    size of the model (a float64 one is twice that). The sum is taken of the changes from a
    reference (the broadcast state, see `WeightedMean`), so rounding is relative to the changes,
    not to the parameters: for n updates it is at most about n * 2**-24 of the largest change.
    The price: the last bit of the mean depends on the order the updates arrived in, and
    training can amplify that; summed in float64, runs repeat bit for bit.
    """
    return np.result_type(dtype, least)


@dataclass
class PartialSum:
    """One shard's part of a round's weighted mean: `sums` holds, by name, the sum over the
    shard's updates of weight x (update - reference), in the accumulator's dtype; `total_weight`
    and `count` are those of the updates summed. The mean over every shard is
    reference + (sum of the shards' sums) / (sum of their total weights)."""

    sums: ArrayGroup
    total_weight: float
    count: int


class WeightedMean:
    """Running weighted mean of named arrays; results in the input dtype.

    Arrays are summed in `dtype` or wider (`accumulator_dtype`). With a `reference` (the arrays
    that were broadcast), each update enters as its weighted
    change from the reference, and the result is reference + sum / total weight; names the
    reference lacks (or holds in another shape that is not a leading slice) are summed as they
    are. `result()` turns the accumulator into the mean in place and hands it out: the
    aggregator is spent after that (`add` raises).
    """

    def __init__(self, reference: Mapping[str, np.ndarray] | None = None, dtype: str = "float32") -> None:
        self._reference = reference or {}
        self._least = np.dtype(dtype)
        self._sums: dict[str, np.ndarray] = {}
        self._dtypes: dict[str, np.dtype] = {}
        self._result: ArrayGroup | None = None
        self._scratch: dict[np.dtype, np.ndarray] = {}
        self.total_weight = 0.0
        self.count = 0

    def add(self, arrays: Mapping[str, np.ndarray], weight: float) -> None:
        if self._result is not None:
            raise ValueError("the mean was already taken; start a new WeightedMean for the next round")
        if weight <= 0 or not np.isfinite(weight):
            raise ValueError(f"weight must be positive and finite, got {weight}")
        if self._sums and set(arrays) != set(self._sums):
            raise ValueError("every update must carry the same array names")
        for key, value in arrays.items():
            if key in self._sums and np.shape(value) != self._sums[key].shape:
                raise ValueError(f"{key}: shape {np.shape(value)} differs from {self._sums[key].shape}")
        if not self._sums:
            self._allocate({key: np.asarray(value) for key, value in arrays.items()})
        for key, value in arrays.items():
            value = np.asarray(value)
            self._fold(self._sums[key], value, self._reference_for(key, value), weight)
        self.total_weight += weight
        self.count += 1

    def _allocate(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Every accumulator at once, as views of one zeroed buffer per accumulator dtype: numpy
        takes huge pages for a large buffer, where one array per name faults 4 KiB pages in one
        at a time (more than half of a 50 MB model's first fold). The mean's arrays are views of
        that buffer too: it lives as long as any of them."""
        dtypes = {key: accumulator_dtype(value.dtype, self._least) for key, value in arrays.items()}
        totals: dict[np.dtype, int] = {}
        for key, value in arrays.items():
            totals[dtypes[key]] = totals.get(dtypes[key], 0) + value.size
        buffers, offsets = {dtype: np.zeros(total, dtype) for dtype, total in totals.items()}, dict.fromkeys(totals, 0)
        for key, value in arrays.items():
            start = offsets[dtypes[key]]
            offsets[dtypes[key]] = start + value.size
            self._sums[key] = buffers[dtypes[key]][start:start + value.size].reshape(value.shape)
            self._dtypes[key] = value.dtype

    def _reference_for(self, key: str, value: np.ndarray) -> np.ndarray | None:
        base = self._reference.get(key)
        return None if base is None else aligned_reference(np.asarray(base), value)

    def _fold(self, total: np.ndarray, value: np.ndarray, reference: np.ndarray | None, weight: float) -> None:
        """total += weight * (value - reference), a block at a time: three array operations per
        block, each rounding as `step = value; step -= reference; step *= weight; total += step`
        does (the difference is taken straight into the scratch block where the reference's
        dtype fits the accumulator's; casting both operands first is then the same arithmetic)."""
        flat_total, flat_value, flat_reference = total.reshape(-1), flat(value), flat(reference)
        scratch = self._scratch_for(total.dtype)
        direct = flat_reference is not None and np.promote_types(flat_reference.dtype, total.dtype) == total.dtype
        for part in blocks(flat_total.size):
            step = scratch[: part.stop - part.start]
            if direct and flat_reference is not None:
                np.subtract(flat_value[part], flat_reference[part], out=step, dtype=total.dtype)
            else:
                step[...] = flat_value[part]
                if flat_reference is not None:
                    step -= flat_reference[part]
            step *= weight
            flat_total[part] += step

    def _scratch_for(self, dtype: np.dtype) -> np.ndarray:
        if dtype not in self._scratch:
            self._scratch[dtype] = np.empty(BLOCK, dtype)
        return self._scratch[dtype]

    def partial(self) -> PartialSum:
        """The running sums as they are (not divided, the reference not added back): what a
        shard aggregator sends; the aggregator is spent after that (`add` raises)."""
        self._result = {}
        return PartialSum(self._sums, self.total_weight, self.count)

    def add_partial(self, partial: PartialSum, dtypes: Mapping[str, np.dtype]) -> None:
        """Fold in another aggregator's sums (`partial`, already checked: the names of every
        other partial, shapes, finite values, the accumulator's dtype); `dtypes` are the
        updates' own dtypes, those of the result."""
        if self._result is not None:
            raise ValueError("the mean was already taken; start a new WeightedMean for the next round")
        if partial.count == 0:
            return
        if self._sums and set(partial.sums) != set(self._sums):
            raise ValueError("every partial must carry the same array names")
        for key, value in partial.sums.items():
            if key in self._sums:
                self._sums[key] += value
            else:
                self._sums[key] = np.array(value, dtype=accumulator_dtype(np.dtype(dtypes[key]), self._least))
                self._dtypes[key] = np.dtype(dtypes[key])
        self.total_weight += partial.total_weight
        self.count += partial.count

    def result(self) -> ArrayGroup:
        if self.count == 0:
            raise ValueError("no update was added")
        if self._result is None:
            self._result = {key: self._finish(key, total) for key, total in self._sums.items()}
            self._scratch.clear()
            self._reference = {}  # the previous state: not kept alive beside the new one
        return self._result

    def _finish(self, key: str, total: np.ndarray) -> np.ndarray:
        total /= self.total_weight
        reference = self._reference_for(key, total)
        if reference is not None:
            flat_total, flat_reference = total.reshape(-1), flat(reference)
            for part in blocks(flat_total.size):
                flat_total[part] += flat_reference[part]
        return total if total.dtype == self._dtypes[key] else total.astype(self._dtypes[key])


def squared_distance(value: np.ndarray, reference: np.ndarray | None) -> float:
    """sum((value - reference)**2) in float64, a block at a time (`reference` None: zeros)."""
    flat_value, flat_reference = flat(value), flat(reference)
    total = 0.0
    for part in blocks(flat_value.size):
        diff = flat_value[part].astype(np.float64)
        if flat_reference is not None:
            diff -= flat_reference[part]
        total += float(np.dot(diff, diff))
    return total


SQUARED_CHANGE_MARGIN = 1 + 2 * BLOCK * 2.0**-24
"""Bounds the relative error of `squared_change_above`'s float32 sums: the changes rounded to
float32 (2**-24 each) and a block of BLOCK squares summed in float32 in any order and grouping
(at most BLOCK * 2**-24 / (1 - BLOCK * 2**-24), Higham's gamma_n), with room to spare."""


def squared_change_above(value: np.ndarray, reference: np.ndarray, scratch: np.ndarray) -> float:
    """An upper bound of the exact sum((value - reference)**2) for float32 arrays of one shape,
    from float32 arithmetic: each block's changes rounded into `scratch` (float32, BLOCK long)
    and their squares summed by BLAS sdot (single-threaded; BLAS's float64 dot is threaded and
    slows to a crawl on busy cores). About 3x faster than `squared_distance`; not finite when a
    value is not finite or a square overflows float32. Underflow is bounded too: at most
    2**-149 per square lost."""
    flat_value, flat_reference = flat(value), flat(reference)
    total = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for part in blocks(flat_value.size):
            step = scratch[: part.stop - part.start]
            np.subtract(flat_value[part], flat_reference[part], out=step)
            total += float(np.dot(step, step))
    return total * SQUARED_CHANGE_MARGIN + flat_value.size * 2.0**-148


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
