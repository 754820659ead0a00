"""Checks on a device's update before anything from it is applied.

Names, dtypes and shapes exactly as the algorithm expects, all values finite, the change from
the broadcast state within a norm bound, a plausible number of examples, then the algorithm's
own checks. The returned weight is the claimed example count, capped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from edge_sdk import codecs
from edge_sdk.params import ArraySpec, check_arrays
from edge_sdk.protocol import ArrayGroup, Envelope, Reason, ValidationError

from .aggregate import aligned_reference, squared_distance

if TYPE_CHECKING:
    from .algorithms.base import ServerAlgorithm


@dataclass(frozen=True)
class UpdateLimits:
    max_examples: int
    max_update_norm: float  # 0 disables the bound


def delta_norm(update: dict[str, ArrayGroup], reference: dict[str, ArrayGroup]) -> float:
    """L2 norm of (update - reference) over the arrays both carry under the same name (the
    reference cut to the update's shape where the update is a slice of it), in float64 without
    full-size temporaries."""
    total = 0.0
    for group, arrays in update.items():
        base = reference.get(group, {})
        for key, value in arrays.items():
            ref = aligned_reference(base[key], value) if key in base else None
            if ref is not None and value.dtype.kind == "f":
                total += squared_distance(value, ref)
    return math.sqrt(total)


def check_update(
    envelope: Envelope,
    spec: dict[str, ArraySpec],
    reference: dict[str, ArrayGroup],
    registered_examples: int,
    limits: UpdateLimits,
) -> float:
    """Raise ValidationError for an update that must be rejected; else return its weight."""
    if set(envelope.groups) != set(spec):
        raise ValidationError(Reason.UNEXPECTED_ARRAYS, f"groups {sorted(envelope.groups)}, want {sorted(spec)}")
    for group, expected in spec.items():
        check_arrays(group, envelope.groups[group], expected)
    claimed = envelope.metrics.get("num_examples")
    if not isinstance(claimed, (int, float)) or not claimed >= 1:
        raise ValidationError(Reason.MALFORMED, f"num_examples {claimed!r}")
    if limits.max_update_norm > 0:
        norm = delta_norm(envelope.groups, reference)
        if norm > limits.max_update_norm:
            raise ValidationError(Reason.NORM_TOO_LARGE, f"update norm {norm:.3g} > {limits.max_update_norm:.3g}")
    return float(min(claimed, registered_examples, limits.max_examples))


def checked_update(algorithm: ServerAlgorithm, round_: int, envelope: Envelope, sent: dict[str, ArrayGroup],
                   registered_examples: int, limits: UpdateLimits, codec: str) -> tuple[dict[str, ArrayGroup], float]:
    """Every check a TRAIN_RES passes before `accumulate`, as the coordinator makes them: the
    upload codec decoded against what was `sent`, `check_update`, then the algorithm's own
    checks. Returns the decoded groups and the update's weight; raises ValidationError."""
    spec = algorithm.update_spec(round_)
    groups = codecs.decode(codec, envelope.groups, sent, spec)
    weight = check_update(replace(envelope, groups=groups), spec, sent, registered_examples, limits)
    algorithm.validate_update(envelope.sender, groups, envelope.metrics, registered_examples)
    return groups, weight
