"""The `topk` upload codec: the k largest entries of a change, with error feedback.

A device sends, per floating array that came down, only the k = ceil(f x n) entries of largest
magnitude of its change (f the run's `topk_fraction`, n the array's size): their sorted indices
into the flattened array (int32, `<name>#index`: the wire has no unsigned 32-bit dtype) and
their float32 values (`<name>`). What it did not send is its residual: kept on the device
(`Residuals`, saved with its personal state, never uploaded) and added to the next change of the
same array before the next selection, so nothing is lost, only delayed (error feedback; Stich et
al. 2018, Karimireddy et al. 2019).
"""

from __future__ import annotations

import math

import numpy as np

from .protocol import ArrayGroup, Reason, ValidationError

INDEX_SUFFIX = "#index"
RESIDUAL_PREFIX = "#topk_residual/"
"""Personal-state keys of residuals: `#topk_residual/<group>/<name>` (no algorithm's name starts with `#`)."""


def kept(fraction: float, size: int) -> int:
    """k: how many entries of an array of `size` values go up (ceil of the float64 product)."""
    return min(size, math.ceil(float(fraction) * float(size)))


def largest(change: np.ndarray, k: int) -> np.ndarray:
    """The sorted int32 indices of the `k` entries of largest magnitude of the flat `change`,
    ties broken towards the lower index (so the choice is deterministic), in O(n)."""
    if k <= 0:
        return np.zeros(0, np.int32)
    magnitude = np.abs(change)
    threshold = np.partition(magnitude, magnitude.size - k)[magnitude.size - k]
    above = np.flatnonzero(magnitude > threshold)
    tied = np.flatnonzero(magnitude == threshold)[:k - above.size]
    return np.sort(np.concatenate([above, tied])).astype(np.int32)


class Residuals:
    """A device's error feedback: per (group, array), what `topk` has not sent yet (float32, the
    array's shape). Reset rules (docs/PROTOCOL.md section 8): a residual whose shape no longer
    matches the change, or that is not finite, is dropped; a run's residuals live in its
    personal state, so a new run starts with none; rounds the device sits out keep them."""

    def __init__(self, arrays: ArrayGroup | None = None):
        self.arrays: dict[tuple[str, str], np.ndarray] = {}
        for key, value in (arrays or {}).items():
            group, _, name = key.removeprefix(RESIDUAL_PREFIX).partition("/")
            self.arrays[group, name] = value

    @staticmethod
    def split(personal: ArrayGroup) -> tuple[ArrayGroup, ArrayGroup]:
        """A saved personal state's (algorithm's arrays, residual arrays)."""
        residual = {k: v for k, v in personal.items() if k.startswith(RESIDUAL_PREFIX)}
        return {k: v for k, v in personal.items() if k not in residual}, residual

    def to_arrays(self) -> ArrayGroup:
        """The residuals as personal-state arrays."""
        return {f"{RESIDUAL_PREFIX}{group}/{name}": value for (group, name), value in self.arrays.items()}

    def fed_back(self, group: str, name: str, change: np.ndarray) -> np.ndarray:
        """`change` plus the residual kept for the array (in place; dropped when its shape differs)."""
        residual = self.arrays.pop((group, name), None)
        if residual is not None and residual.shape == change.shape:
            change += residual
        return change

    def keep(self, group: str, name: str, residual: np.ndarray) -> None:
        """Keep what was not sent of the array, unless it is not finite (a diverged round)."""
        if np.all(np.isfinite(residual)):
            self.arrays[group, name] = residual


def sparsify(change: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values, indices, residual) of a float32 `change`: the top k entries and what is left."""
    flat = change.reshape(-1)
    index = largest(flat, kept(fraction, flat.size))
    values = flat[index].astype(np.float32)
    residual = flat.copy()
    residual[index] = 0.0
    return values, index, residual.reshape(change.shape)


def densify(values: np.ndarray, index: np.ndarray | None, shape: tuple[int, ...], fraction: float,
            where: str) -> np.ndarray:
    """The float32 change of `shape` that `values` at `index` carry (zero elsewhere). Raises
    ValidationError naming `where`: `malformed` for a missing or non-int32 index, lengths that
    differ or exceed k, indices out of range, unsorted or repeated; `bad_dtype` for values not float32."""
    size = int(np.prod(shape, dtype=np.int64))
    if index is None or index.dtype != np.int32 or index.ndim != 1:
        raise ValidationError(Reason.MALFORMED, f"{where}: topk needs a 1-d int32 {where}{INDEX_SUFFIX}")
    if values.dtype != np.float32:
        raise ValidationError(Reason.BAD_DTYPE, f"{where}: topk values must be float32, got {values.dtype}")
    if values.shape != index.shape:
        raise ValidationError(Reason.MALFORMED, f"{where}: {values.size} topk values for {index.size} indices")
    if index.size > kept(fraction, size):
        raise ValidationError(Reason.MALFORMED, f"{where}: {index.size} topk entries, at most "
                                                f"{kept(fraction, size)} (topk_fraction {fraction} of {size})")
    if np.any(index[1:] <= index[:-1]):
        raise ValidationError(Reason.MALFORMED, f"{where}: topk indices must be strictly increasing")
    if index.size and (int(index[0]) < 0 or int(index[-1]) >= size):
        raise ValidationError(Reason.MALFORMED, f"{where}: topk indices out of range [0, {size})")
    change = np.zeros(size, np.float32)
    change[index] = values
    return change.reshape(shape)
