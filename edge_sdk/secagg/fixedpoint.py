"""Fixed-point quantization of float vectors into the ring Z_{2^32} that secure aggregation sums in.

Each summand clips its values to [-bound, bound], scales them by an integer `scale` and rounds
stochastically (up with probability equal to the fractional part), so the encoding is unbiased;
negative values wrap to two's complement in uint32. The ring sum of the encodings, read back as
int32 and divided by `scale`, is the float sum.

Guarantees, per coordinate: the decoded sum of n encodings differs from the sum of the clipped
inputs by less than n/scale (each rounding moves a value by less than one unit, 1/scale), and it
cannot wrap while the number of summands is at most `summands`: `scale` leaves room for the
rounding, summands * ceil(scale * bound) <= 2**31 - 1.
"""

from __future__ import annotations

import math

import numpy as np

from .errors import SecAggError

_INT32_MAX = 2**31 - 1


class FixedPoint:
    """Quantizer for values in [-bound, bound], of which up to `summands` are added up."""

    def __init__(self, bound: float, summands: int) -> None:
        if not math.isfinite(bound) or bound <= 0:
            raise SecAggError(f"bound must be a positive finite number, got {bound!r}")
        if not isinstance(summands, int) or isinstance(summands, bool) or summands < 1:
            raise SecAggError(f"summands must be an int >= 1, got {summands!r}")
        self.bound = float(bound)
        self.summands = summands
        # One unit of rounding headroom per summand, so that n values of ceil(scale*bound) still fit.
        scale = math.floor((_INT32_MAX - summands) / (summands * self.bound))
        if scale < 1:
            raise SecAggError(f"scale {scale} < 1: bound {bound} with {summands} summands leaves no precision")
        self.scale = scale

    @property
    def max_error_per_summand(self) -> float:
        """The rounding error one encoding can add to a coordinate of the sum, at most (exclusive)."""
        return 1.0 / self.scale

    def encode(self, values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Clip, scale and stochastically round `values` into uint32 (two's complement)."""
        scaled = np.array(values, dtype=np.float64)  # a copy, worked on in place
        np.clip(scaled, -self.bound, self.bound, out=scaled)
        scaled *= self.scale
        if not np.all(np.isfinite(scaled)):
            raise SecAggError("values to encode must be finite")
        rounded = np.floor(scaled)
        fraction = np.subtract(scaled, rounded, out=scaled)
        rounded += rng.random(scaled.shape) < fraction
        # |rounded| <= ceil(scale * bound) < 2**31 (see __init__): int32 holds it, and its bits are the uint32
        return rounded.astype(np.int32).view(np.uint32)

    def decode_sum(self, total: np.ndarray) -> np.ndarray:
        """The float sum that the uint32 ring sum `total` of encodings stands for."""
        if not isinstance(total, np.ndarray) or total.dtype != np.uint32:
            raise SecAggError("total must be a uint32 numpy array")
        return total.view(np.int32).astype(np.float64) / self.scale
