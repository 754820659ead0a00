"""Upload codecs: fewer bytes per update, for constrained uplinks.

A device encodes what it uploads, the coordinator decodes it before validation, so algorithms
never see a codec. Floating arrays that also came down (same name and shape) travel as their
change from the broadcast value, which is small and quantizes well; the others (statistics,
new arrays) travel as they are. `fp16` halves the bytes; `int8` quarters them with one float32
scale per array (symmetric, per tensor), stored beside it as `<name>#scale`.
"""

from __future__ import annotations

import numpy as np

from .protocol import ArrayGroup, Reason, ValidationError

CODECS = ("fp32", "fp16", "int8")
SCALE_SUFFIX = "#scale"


def _reference(key: str, value: np.ndarray, reference: ArrayGroup) -> np.ndarray | None:
    base = reference.get(key)
    return base if base is not None and base.shape == value.shape and base.dtype.kind == "f" else None


def encode(codec: str, groups: dict[str, ArrayGroup], received: dict[str, ArrayGroup]) -> dict[str, ArrayGroup]:
    """What a device sends instead of `groups` under `codec` (`received`: what came down)."""
    if codec not in CODECS:
        raise ValueError(f"codec must be one of {', '.join(CODECS)}, got {codec!r}")
    if codec == "fp32":
        return groups
    out: dict[str, ArrayGroup] = {}
    for group, arrays in groups.items():
        out[group] = {}
        for key, value in arrays.items():
            if value.dtype.kind != "f":
                out[group][key] = value
                continue
            base = _reference(key, value, received.get(group, {}))
            delta = value.astype(np.float32) - (base.astype(np.float32) if base is not None else 0.0)
            if codec == "fp16":
                out[group][key] = delta.astype(np.float16)
            else:
                scale = float(np.abs(delta).max()) / 127.0 if delta.size else 0.0
                q = np.round(delta / scale) if scale > 0 else np.zeros_like(delta)
                out[group][key] = np.clip(q, -127, 127).astype(np.int8)
                out[group][key + SCALE_SUFFIX] = np.array(scale, dtype=np.float32)
    return out


def decode(codec: str, groups: dict[str, ArrayGroup], sent: dict[str, ArrayGroup],
           expected: dict[str, dict[str, tuple[tuple[int, ...], str]]]) -> dict[str, ArrayGroup]:
    """The coordinator's inverse of `encode`: back to the dtypes `expected` names, adding what was
    broadcast (`sent`) where the device encoded a change. Malformed input raises ValidationError."""
    if codec == "fp32":
        return groups
    out: dict[str, ArrayGroup] = {}
    for group, arrays in groups.items():
        spec = expected.get(group, {})
        out[group] = {}
        for key, value in arrays.items():
            if codec == "int8" and key.endswith(SCALE_SUFFIX):
                continue
            if key not in spec or np.dtype(spec[key][1]).kind != "f":
                out[group][key] = value
                continue
            wanted = np.dtype(spec[key][1])
            delta = np.empty(value.shape, np.float32)
            if codec == "fp16":
                if value.dtype != np.float16:
                    raise ValidationError(Reason.BAD_DTYPE, f"{group}/{key}: fp16 codec, got {value.dtype}")
                np.copyto(delta, value)
            else:
                scale = arrays.get(key + SCALE_SUFFIX)
                if value.dtype != np.int8 or scale is None or scale.shape != () or not np.isfinite(scale):
                    raise ValidationError(Reason.MALFORMED, f"{group}/{key}: int8 codec needs int8 data and a scale")
                np.multiply(value, np.float32(scale), out=delta, dtype=np.float32)
            out[group][key] = _restored(delta, _reference(key, delta, sent.get(group, {})), wanted)
    return out


def _restored(delta: np.ndarray, base: np.ndarray | None, wanted: np.dtype) -> np.ndarray:
    """`delta + base` in float32 (the base rounded to float32 first), in the dtype `wanted`:
    computed in place in `delta`, so one full-size array is made, not four."""
    if base is not None:
        np.add(delta, base, out=delta, dtype=np.float32)
    return delta if wanted == np.float32 else delta.astype(wanted)
