"""Pure checks of a device's replies, each returning what is wrong in words (empty: nothing).

The coordinator's own checks (`validation.checked_update`, `PrototypePool.check`) decide
whether an update or a prototype group would be accepted; these add what a reply must carry to
be matched to its request at all (docs/PROTOCOL.md sections 7 and 9) and what the kit compares
across replies (a repeated request's cached reply, the int8 codec's scale).
"""

from __future__ import annotations

import math

import numpy as np

from edge_sdk.codecs import SCALE_SUFFIX
from edge_sdk.protocol import Envelope, Kind


def answers(reply: Envelope, request: Envelope) -> bool:
    """Whether `reply` names `request` as what it answers."""
    return reply.config.get("in_reply_to") == request.msg_id


def reply_to(request: Envelope, kind: Kind):
    """A matcher for the reply of `kind` to `request`: one that names it, or one of that kind that
    names no request at all (then `reply_problems` says so)."""
    return lambda envelope: envelope.kind is kind and (answers(envelope, request)
                                                       or "in_reply_to" not in envelope.config)


def reply_problems(reply: Envelope, request: Envelope, run_id: str) -> list[str]:
    """What keeps a coordinator from matching `reply` to `request` (the reply check of section 9)."""
    problems = []
    named = reply.config.get("in_reply_to")
    if named is None:
        problems.append(f"config.in_reply_to is missing (it must be the {request.kind.value.upper()}'s msg_id "
                        f"{request.msg_id}: a coordinator refuses the reply as stale)")
    elif named != request.msg_id:
        problems.append(f"config.in_reply_to is {named!r}, not the {request.kind.value.upper()}'s msg_id "
                        f"{request.msg_id}")
    if reply.run_id != run_id:
        problems.append(f"run_id is {reply.run_id!r}, not the run's {run_id!r} (wrong_run)")
    if reply.round != request.round:
        problems.append(f"round is {reply.round}, not the request's {request.round} (stale)")
    return problems


def accuracy_problem(reply: Envelope) -> str | None:
    accuracy = reply.metrics.get("accuracy")
    if not isinstance(accuracy, (int, float)) or not math.isfinite(accuracy) or not 0 <= accuracy <= 1:
        return f"metrics.accuracy is {accuracy!r}, not a number in [0, 1] (malformed)"
    return None


def cached_reply_problem(repeat: Envelope, first: Envelope) -> str | None:
    """Why `repeat`, the answer to a repeated request, is not the cached `first` reply."""
    if repeat.msg_id != first.msg_id:
        return (f"the repeated request got a new reply (msg_id {repeat.msg_id}, not the cached {first.msg_id}): "
                "the device worked again instead of re-sending its cached reply")
    if repeat.metrics != first.metrics or repeat.groups.keys() != first.groups.keys():
        return "the repeated reply has the same msg_id but other metrics or groups"
    for group, arrays in first.groups.items():
        again = repeat.groups[group]
        if arrays.keys() != again.keys() or any(not np.array_equal(arrays[k], again[k]) for k in arrays):
            return f"the repeated reply has the same msg_id but other arrays in group {group!r}"
    return None


def int8_problems(groups: dict[str, dict[str, np.ndarray]]) -> list[str]:
    """Section 8: every int8 array has a float32 scalar scale, and the largest |q| is 127 when
    the scale is positive (s = max|delta| / 127, q = round(delta / s))."""
    problems = []
    for group, arrays in groups.items():
        for key, value in arrays.items():
            if key.endswith(SCALE_SUFFIX) or value.dtype != np.int8:
                continue
            scale = arrays.get(key + SCALE_SUFFIX)
            if scale is None or scale.dtype != np.float32 or scale.shape != ():
                problems.append(f"{group}/{key}: no float32 scalar {key + SCALE_SUFFIX}")
            elif float(scale) > 0 and value.size and int(np.abs(value.astype(np.int16)).max()) != 127:
                problems.append(f"{group}/{key}: largest |q| is {int(np.abs(value.astype(np.int16)).max())}, "
                                "not 127 (s must be max|delta| / 127)")
    return problems
