"""A device's shared upload as one vector for the secure sum, and the sum back as arrays.

Secure aggregation sums vectors, so a device turns what it would upload into the terms of an
example-weighted mean: its change from what came down, clipped as one vector to the L2 bound C
(every floating array of every group together, as under DP), times its weight w = its examples
over the round's largest count (so w <= 1), followed by w itself. Summed over the round's
survivors, the vector holds the numerator and the denominator of the weighted mean, which is
what a shard aggregator's partial sum holds too. Integer arrays (BatchNorm's batch counters)
carry no gradient: their change is 0, as under DP, and the mean keeps what was broadcast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..params import ArraySpec, aligned_reference, flat
from ..privacy.upstream import change_norm
from ..protocol import ArrayGroup


@dataclass(frozen=True)
class Slot:
    """Where one floating array lies in the vector."""

    group: str
    key: str
    shape: tuple[int, ...]
    start: int
    stop: int


class VectorLayout:
    """The order of a round's upload in the secure sum: its groups and names sorted, floating
    arrays only, then one element for the weight. Both sides build it from the round's
    `update_spec`, so nothing about the layout travels."""

    def __init__(self, spec: dict[str, ArraySpec]):
        self.spec = spec
        slots, start = [], 0
        for group in sorted(spec):
            for key in sorted(spec[group]):
                shape, dtype = spec[group][key]
                if np.dtype(dtype).kind != "f":
                    continue
                size = math.prod(shape)
                slots.append(Slot(group, key, tuple(shape), start, start + size))
                start += size
        self.slots: tuple[Slot, ...] = tuple(slots)
        self.length = start + 1
        """Elements of the vector: every floating value, and the weight last."""

    def encode(self, groups: dict[str, ArrayGroup], received: dict[str, ArrayGroup], clip: float,
               weight: float) -> np.ndarray:
        """weight x (the change from `received`, clipped to L2 norm `clip`), then `weight`, in float64."""
        if not (0 < weight <= 1):
            raise ValueError(f"the weight of a secure upload must be in (0, 1], got {weight}")
        norm = change_norm(groups, received)
        scale = weight * (min(1.0, clip / norm) if norm > 0 else 1.0)
        vector = np.empty(self.length)
        for slot in self.slots:
            value = groups[slot.group][slot.key]
            if value.shape != slot.shape:
                raise ValueError(f"{slot.group}/{slot.key}: shape {value.shape}, the round's is {slot.shape}")
            base = received.get(slot.group, {}).get(slot.key)
            reference = None if base is None else aligned_reference(np.asarray(base), value)
            change = vector[slot.start:slot.stop]  # worked out in place: no temporaries
            if reference is None:
                change[:] = flat(value)
            else:
                np.subtract(flat(value), flat(reference), out=change, dtype=np.float64)
            change *= scale
        vector[-1] = weight
        return vector

    def decode(self, total: np.ndarray) -> tuple[dict[str, ArrayGroup], float]:
        """The sums by group and name (zeros for integer arrays), and the total weight, from a
        summed vector."""
        if total.shape != (self.length,):
            raise ValueError(f"a secure sum of this round has {self.length} elements, got shape {total.shape}")
        sums: dict[str, ArrayGroup] = {group: {key: np.zeros(shape) for key, (shape, _) in arrays.items()}
                                       for group, arrays in self.spec.items()}
        for slot in self.slots:
            sums[slot.group][slot.key] = total[slot.start:slot.stop].reshape(slot.shape)
        return sums, float(total[-1])
