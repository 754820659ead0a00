"""What a model looks like from outside: its state names and shapes, and the first difference.

The coordinator compares a registering device's signature with its own, so a device built from
another model is refused by name at registration, not by a crash in the middle of a round.
"""

from __future__ import annotations

from torch import nn

Signature = list[tuple[str, tuple[int, ...]]]


def model_signature(module: nn.Module) -> Signature:
    """(name, shape) of every `state_dict` entry (parameters and buffers), in order."""
    return [(name, tuple(int(s) for s in tensor.shape)) for name, tensor in module.state_dict().items()]


MAX_ENTRIES = 100_000
"""The most state entries a signature that came over the network may list."""


def signature_to_plain(signature: Signature) -> list[list]:
    """A signature as msgpack-safe lists: [[name, [dims...]], ...]."""
    return [[name, list(shape)] for name, shape in signature]


def signature_from_plain(value: object) -> Signature:
    """A signature from its plain form (from the network): a list of [name, [dims...]] with
    string names and non-negative integer dims; anything else raises ValueError."""
    if not isinstance(value, list) or len(value) > MAX_ENTRIES:
        raise ValueError("a model signature is a list of [name, shape] entries")
    signature: Signature = []
    for entry in value:
        if (not isinstance(entry, (list, tuple)) or len(entry) != 2 or not isinstance(entry[0], str)
                or not isinstance(entry[1], (list, tuple))
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry[1])):
            raise ValueError(f"malformed model signature entry {entry!r:.80}")
        signature.append((entry[0], tuple(entry[1])))
    return signature


def first_mismatch(expected: Signature, actual: Signature) -> str | None:
    """A sentence naming the first entry where `actual` (a device's) differs from `expected`
    (the coordinator's), or None when they agree."""
    # The common prefix first; a longer list on either side is named after it.
    pairs = enumerate(zip(expected, actual, strict=False))
    for index, ((want_name, want_shape), (got_name, got_shape)) in pairs:
        if want_name != got_name:
            return (f"parameter {index}: the coordinator's model has {want_name!r} {list(want_shape)}, this one "
                    f"{got_name!r} {list(got_shape)}")
        if tuple(want_shape) != tuple(got_shape):
            return (f"parameter {want_name!r}: the coordinator's has shape {list(want_shape)}, "
                    f"this one {list(got_shape)}")
    if len(expected) > len(actual):
        name, shape = expected[len(actual)]
        return (f"parameter {name!r} {list(shape)} of the coordinator's model is missing "
                f"({len(actual)} of {len(expected)})")
    if len(actual) > len(expected):
        name, shape = actual[len(expected)]
        return (f"parameter {name!r} {list(shape)} is not in the coordinator's model "
                f"({len(actual)}, not {len(expected)})")
    return None
