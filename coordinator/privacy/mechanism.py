"""The coordinator's half of the DP mechanisms: the fixed-denominator mean of clipped changes,
with Gaussian noise under central DP, and the noised mean of the devices' accuracies.

DP-FedAvg's estimator replaces the example-weighted mean: every update counts the same (a
weight by examples would let one device's data move the aggregate by more than C), and the sum
is divided by the expected number of participants m, not by the number that replied (that
number depends on who took part). So the aggregate is

    reference + (sum of clipped changes + N(0, (z C)^2)) / m

Central DP clips every change again here (a device's own clipping is not trusted) and adds the
noise once per aggregate; local DP's changes arrive noised by their devices and are only summed.
What this costs against the plain mean: the noise, a shrink toward the reference when fewer than
m devices reply, and the loss of weighting by examples.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from edge_sdk.params import aligned_reference
from edge_sdk.protocol import ArrayGroup


class PrivateMean:
    """One round's DP aggregate of named arrays (the `Aggregator` protocol; weights are ignored).

    `reference` is what the round broadcast, `clip` C (0: the changes are summed as they come,
    local DP), `std` the noise's standard deviation on the sum (z*C; 0 under local DP) and
    `expected` the fixed denominator m."""

    def __init__(self, reference: Mapping[str, np.ndarray], *, clip: float, std: float, expected: float,
                 rng: np.random.Generator):
        if expected <= 0:
            raise ValueError(f"the expected number of participants must be positive, got {expected}")
        self.reference, self.clip, self.std, self.expected, self.rng = reference, clip, std, expected, rng
        self.sums: dict[str, np.ndarray] = {}
        self.integers: set[str] = set()
        self.count = 0
        self.clipped = 0

    def add(self, arrays: Mapping[str, np.ndarray], weight: float) -> None:
        changes = {key: self._change(key, np.asarray(value)) for key, value in arrays.items()}
        if self.count and set(changes) != set(self.sums) | self.integers:
            raise ValueError("every update must carry the same array names")
        norm = math.sqrt(sum(float(np.vdot(change, change)) for change in changes.values() if change is not None))
        scale = self.clip / norm if self.clip > 0 and norm > self.clip else 1.0
        self.clipped += scale < 1.0
        for key, change in changes.items():
            if change is None:
                self.integers.add(key)
                continue
            total = self.sums.setdefault(key, np.zeros(change.shape))
            total += scale * change
        self.count += 1

    def _change(self, key: str, value: np.ndarray) -> np.ndarray | None:
        """The float64 change of one floating array from the reference (None: an integer array)."""
        if value.dtype.kind != "f":
            return None
        base = self.reference.get(key)
        reference = None if base is None else aligned_reference(np.asarray(base), value)
        change = value.astype(np.float64)
        return change if reference is None else change - reference

    def result(self) -> ArrayGroup:
        """reference + (sum + noise) / m, in the reference's dtypes; integer arrays as broadcast."""
        if not self.count:
            raise ValueError("no update was added")
        out: ArrayGroup = {}
        for key, total in self.sums.items():
            base = self.reference.get(key)
            reference = None if base is None else aligned_reference(np.asarray(base), total)
            noise = self.rng.normal(0.0, self.std, size=total.shape) if self.std > 0 else 0.0
            mean = (total + noise) / self.expected
            dtype = np.float32 if reference is None else reference.dtype
            out[key] = (mean if reference is None else reference + mean).astype(dtype)
        for key in self.integers:
            out[key] = np.array(self.reference[key])
        return out


def centred_count(within: list[float]) -> float:
    """The count of devices within C that adaptive clipping noises, each bit b (0 or 1) centred
    as b - 1/2 (Andrew et al. 2021, Section 3): one device added or removed moves it by 1/2, the
    sensitivity the split of the noise between the update and the count assumes
    (`RunPrivacy.update_noise`). Replacing a device's data moves it by at most 1, as it moves the
    update's sum by 2C: the same split holds under fixed sampling."""
    return sum(b - 0.5 for b in within)


def within_share(within: list[float], noise: float, expected: float) -> float:
    """The share of devices within C as adaptive clipping estimates it: the centred count plus
    its noise over the fixed denominator m, de-centred (+ 1/2)."""
    return (centred_count(within) + noise) / expected + 0.5


def noised_mean(values: list[float], std: float, rng: np.random.Generator) -> float | None:
    """The mean of `values` (each in [0, 1] as measured) with N(0, std^2) added to their sum
    (central DP of an evaluation; std 0: the values were noised by their devices). None for none."""
    if not values:
        return None
    noise = rng.normal(0.0, std) if std > 0 else 0.0
    return float((sum(min(1.0, max(0.0, v)) if std > 0 else v for v in values) + noise) / len(values))
