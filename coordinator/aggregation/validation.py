"""Checks on a device's update before anything from it is applied.

Names, dtypes and shapes exactly as the algorithm expects, all values finite, the change from
the broadcast state within a norm bound, a plausible number of examples, then the algorithm's
own checks. The returned weight is the claimed example count, capped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from edge_sdk import codecs
from edge_sdk.config import ConfigError
from edge_sdk.params import ArraySpec, aligned_reference, block_buffer, check_arrays
from edge_sdk.protocol import ArrayGroup, Envelope, Reason, ValidationError

from .averaging import squared_change_above, squared_distance

if TYPE_CHECKING:
    from ..algorithms.base import ServerAlgorithm


@dataclass(frozen=True)
class UpdateLimits:
    max_examples: int
    max_update_norm: float  # 0 disables the bound
    weighted: bool = True
    """Updates are weighted by the examples they claim; False under DP, where every update
    weighs 1 and a device reports no example count."""


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


def norm_over(update: dict[str, ArrayGroup], reference: dict[str, ArrayGroup], bound: float) -> float | None:
    """`delta_norm(update, reference)` where it exceeds `bound`, else None: the same decision.
    Float32 updates well within the bound, the common case, are settled by an upper bound of
    their norm computed in float32 with a proven error margin (`squared_change_above`, 3x
    faster); the float64 norm is computed only for the others (within 0.4% of the bound or
    over it, other dtypes, an overflow)."""
    if math.sqrt(_squared_change_above(update, reference)) * (1 + 1e-9) < bound:  # 1e-9: delta_norm's rounding
        return None
    norm = delta_norm(update, reference)
    return norm if norm > bound else None


def _squared_change_above(update: dict[str, ArrayGroup], reference: dict[str, ArrayGroup]) -> float:
    """An upper bound of delta_norm's sum of squares; infinite where an array is not float32."""
    scratch = block_buffer(np.float32, "changes")
    total = 0.0
    for group, arrays in update.items():
        base = reference.get(group, {})
        for key, value in arrays.items():
            ref = aligned_reference(base[key], value) if key in base else None
            if ref is None or value.dtype.kind != "f":
                continue
            if value.dtype != np.float32 or ref.dtype != np.float32:
                return math.inf
            total += squared_change_above(value, ref, scratch)
    return total


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
    if limits.weighted and (not isinstance(claimed, (int, float)) or not claimed >= 1):
        raise ValidationError(Reason.MALFORMED, f"num_examples {claimed!r}")
    if limits.max_update_norm > 0:
        norm = norm_over(envelope.groups, reference, limits.max_update_norm)
        if norm is not None:
            raise ValidationError(Reason.NORM_TOO_LARGE, f"update norm {norm:.3g} > {limits.max_update_norm:.3g}")
    if not limits.weighted or not isinstance(claimed, (int, float)):
        return 1.0
    return float(min(claimed, registered_examples, limits.max_examples))


def check_upload_codec(codec: str, algorithm: type[ServerAlgorithm]) -> None:
    """Refuse, before anything starts, a lossy upload codec (any but fp32: fp16, int8, q4, q2,
    topk) for an algorithm whose uploads cannot take one (`ServerAlgorithm.lossy_uploads`),
    naming the key: every update would be refused."""
    if codec != "fp32" and algorithm.lossy_uploads is not None:
        raise ConfigError(f"upload_codec: {algorithm.id} cannot take {codec}: {algorithm.lossy_uploads}")


def checked_update(algorithm: ServerAlgorithm, round_: int, envelope: Envelope, sent: dict[str, ArrayGroup],
                   registered_examples: int, limits: UpdateLimits,
                   codec: str | codecs.UploadCodec) -> tuple[dict[str, ArrayGroup], float]:
    """Every check a TRAIN_RES passes before `accumulate`, as the coordinator makes them: the
    upload codec decoded against what was `sent`, `check_update`, then the algorithm's own
    checks. Returns the decoded groups and the update's weight; raises ValidationError."""
    spec = algorithm.update_spec(round_)
    groups = codecs.decode(codec, envelope.groups, sent, spec)
    weight = check_update(replace(envelope, groups=groups), spec, sent, registered_examples, limits)
    algorithm.validate_update(envelope.sender, groups, envelope.metrics, registered_examples)
    return groups, weight
