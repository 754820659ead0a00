"""The coordinator checks what it is about to send against the rules a device applies.

A device refuses a TRAIN or EVALUATE whose arrays do not match its model (names, dtypes,
shapes) or carry non-finite values; every selected device then refuses the same broadcast, and
a round that nobody can answer would wait out its whole timeout. Such a broadcast is always
the coordinator's own mistake (a bad `--init-from`, or a bug in an aggregation), so the
coordinator looks before it sends and stops the run at once, naming the array.

The reference is the spec of the algorithm's initial global state, built from the run's model
before anything overlaid or aggregated it. Groups that the initial state does not hold (class
means that appear once devices sent some) are checked for finite values only. An algorithm
whose broadcast carries leading slices of its parameters (CD2-pFed's shared channels) checks
dtypes and that each array is such a slice.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from edge_sdk.config import ConfigError
from edge_sdk.params import ArraySpec, all_finite
from edge_sdk.protocol import ArrayGroup


class OutgoingError(ConfigError):
    """A request the coordinator was about to send that every device would refuse."""


def _fits(shape: tuple[int, ...], expected: tuple[int, ...], sliced: bool) -> bool:
    if sliced:
        return len(shape) == len(expected) and all(0 <= n <= m for n, m in zip(shape, expected, strict=True))
    return tuple(shape) == tuple(expected)


def check_outgoing(what: str, groups: Mapping[str, ArrayGroup], model_spec: Mapping[str, ArraySpec], *,
                   sliced: bool = False) -> None:
    """Raise OutgoingError for the first array of `groups` (what the request `what` carries)
    that a device would refuse: a name, dtype or shape other than the initial state's
    (`model_spec`, by group), or a non-finite value."""
    for group, arrays in groups.items():
        expected = model_spec.get(group) or {}
        if expected and set(arrays) != set(expected):
            missing, extra = sorted(set(expected) - set(arrays)), sorted(set(arrays) - set(expected))
            raise OutgoingError(f"{what}: {group} lacks {missing[:3]} and has {extra[:3]} beyond the run's model; "
                                "every device would refuse it (a bad --init-from, or a bug); the run stops")
        for name, array in arrays.items():
            if name in expected:
                shape, dtype = expected[name]
                if array.dtype.name != dtype or not _fits(array.shape, shape, sliced):
                    raise OutgoingError(f"{what}: {group}/{name} is {array.dtype.name}{list(array.shape)} but the "
                                        f"run's model has {dtype}{list(shape)}; every device would refuse it (a bad "
                                        "--init-from, or a bug); the run stops")
            if isinstance(array, np.ndarray) and array.dtype.kind == "f" and not all_finite(array):
                raise OutgoingError(f"{what}: {group}/{name} has non-finite values; every device would refuse it; "
                                    "the run stops")
