"""Upload codecs: fewer bytes per update, for constrained uplinks.

A device encodes what it uploads, the coordinator decodes it before validation, so algorithms
never see a codec. Floating arrays that also came down (same name and shape) travel as their
change from the broadcast value, which is small and compresses well. `fp16` halves the bytes;
`int8` quarters them with one float32 scale per array (symmetric, per tensor), stored beside it
as `<name>#scale`; `q4` and `q2` quantize stochastically per block of 256 values
(`quantized_codec`); `topk` sends the largest entries only, with error feedback (`sparse_codec`).
Under `fp16` and `int8` the other float arrays (statistics, new arrays) travel as their value,
encoded alike; under `topk`, `q4` and `q2` they travel unchanged, in full precision (they are
values, not changes: neither sparse nor centred on zero). This module dispatches.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from . import quantized_codec, sparse_codec
from .protocol import ArrayGroup, Reason, ValidationError
from .settings import TrainSettings
from .sparse_codec import INDEX_SUFFIX, Residuals

CODECS = ("fp32", "fp16", "int8", "topk", "q4", "q2")
SCALE_SUFFIX = "#scale"
DEFAULT_TOPK_FRACTION = float(TrainSettings().topk_fraction)
CHANGE_ONLY = ("topk", "q4", "q2")
"""Codecs that encode changes only: an array that did not come down travels unchanged."""


@dataclass(frozen=True)
class UploadCodec:
    """A run's upload codec: its name and, for `topk`, the fraction of entries kept."""

    name: str = "fp32"
    topk_fraction: float = DEFAULT_TOPK_FRACTION

    @classmethod
    def of(cls, settings: TrainSettings) -> UploadCodec:
        """The codec a run's training settings announce."""
        return cls(settings.upload_codec, settings.topk_fraction)


def rounding_generator(seed: int, round_: int, client_id: str) -> np.random.Generator:
    """Where a device's `q4` / `q2` rounding draws come from: the run's seed, the round and the
    device, so a rerun sends the same bytes and two devices never round alike."""
    digest = hashlib.sha256(f"{client_id}/upload_codec".encode()).digest()
    return np.random.default_rng([seed, round_, int.from_bytes(digest[:8], "little")])


def _codec(codec: str | UploadCodec) -> UploadCodec:
    """`codec` as an UploadCodec (a bare name takes the default fraction); ValueError if unknown."""
    spec = UploadCodec(codec) if isinstance(codec, str) else codec
    if spec.name not in CODECS:
        raise ValueError(f"codec must be one of {', '.join(CODECS)}, got {spec.name!r}")
    return spec


def _reference(key: str, shape: tuple[int, ...], reference: ArrayGroup) -> np.ndarray | None:
    """The float array `key` of `reference` if it has `shape`: what a change is taken from."""
    base = reference.get(key)
    return base if base is not None and base.shape == shape and base.dtype.kind == "f" else None


def encode(codec: str | UploadCodec, groups: dict[str, ArrayGroup], received: dict[str, ArrayGroup], *,
           rng: np.random.Generator | None = None, residuals: Residuals | None = None) -> dict[str, ArrayGroup]:
    """What a device sends instead of `groups` under `codec` (`received`: what came down).
    `q4` and `q2` draw their rounding from `rng` (required); `topk` feeds back and updates
    `residuals` when given (without, what is not sent is dropped)."""
    spec = _codec(codec)
    if spec.name == "fp32":
        return groups
    if spec.name in quantized_codec.LEVELS and rng is None:
        raise ValueError(f"codec {spec.name} rounds at random: pass rng")
    out: dict[str, ArrayGroup] = {}
    for group, arrays in groups.items():
        out[group] = {}
        for key, value in arrays.items():
            base = _reference(key, value.shape, received.get(group, {})) if value.dtype.kind == "f" else None
            if value.dtype.kind != "f" or (base is None and spec.name in CHANGE_ONLY):
                out[group][key] = value
                continue
            delta = value.astype(np.float32) - (base.astype(np.float32) if base is not None else np.float32(0.0))
            out[group].update(_encoded(spec, group, key, delta, rng, residuals))
    return out


def _encoded(spec: UploadCodec, group: str, key: str, delta: np.ndarray, rng: np.random.Generator | None,
             residuals: Residuals | None) -> ArrayGroup:
    """The arrays one float change `delta` of array `key` goes up as."""
    if spec.name == "fp16":
        return {key: delta.astype(np.float16)}
    if spec.name == "int8":
        scale = float(np.abs(delta).max()) / 127.0 if delta.size else 0.0
        q = np.round(delta / np.float32(scale)) if scale > 0 else np.zeros_like(delta)
        return {key: np.clip(q, -127, 127).astype(np.int8), key + SCALE_SUFFIX: np.array(scale, dtype=np.float32)}
    if spec.name == "topk":
        if residuals is not None:
            delta = residuals.fed_back(group, key, delta)
        values, index, residual = sparse_codec.sparsify(delta, spec.topk_fraction)
        if residuals is not None:
            residuals.keep(group, key, residual)
        return {key: values, key + INDEX_SUFFIX: index}
    assert rng is not None  # encode checked it
    packed, scales = quantized_codec.quantize(spec.name, delta, rng)
    return {key: packed, key + SCALE_SUFFIX: scales}


def decode(codec: str | UploadCodec, groups: dict[str, ArrayGroup], sent: dict[str, ArrayGroup],
           expected: dict[str, dict[str, tuple[tuple[int, ...], str]]]) -> dict[str, ArrayGroup]:
    """The coordinator's inverse of `encode`: back to the dtypes `expected` names, adding what was
    broadcast (`sent`) where the device encoded a change. Malformed input raises ValidationError."""
    spec = _codec(codec)
    if spec.name == "fp32":
        return groups
    suffix = INDEX_SUFFIX if spec.name == "topk" else SCALE_SUFFIX
    out: dict[str, ArrayGroup] = {}
    for group, arrays in groups.items():
        wanted_arrays = expected.get(group, {})
        out[group] = {}
        for key, value in arrays.items():
            if key.endswith(suffix) and spec.name != "fp16":
                if spec.name in CHANGE_ONLY and key.removesuffix(suffix) not in arrays:
                    raise ValidationError(Reason.UNEXPECTED_ARRAYS, f"{group}/{key} without {key.removesuffix(suffix)}")
                continue
            if key not in wanted_arrays or np.dtype(wanted_arrays[key][1]).kind != "f":
                out[group][key] = value
                continue
            shape, wanted = tuple(wanted_arrays[key][0]), np.dtype(wanted_arrays[key][1])
            if spec.name in CHANGE_ONLY and _reference(key, shape, sent.get(group, {})) is None:
                out[group][key] = value  # not a change: it travels as it is, checked as any array
                continue
            delta = _decoded(spec, value, arrays.get(key + suffix), shape, f"{group}/{key}")
            out[group][key] = _restored(delta, _reference(key, delta.shape, sent.get(group, {})), wanted)
    return out


def _decoded(spec: UploadCodec, value: np.ndarray, side: np.ndarray | None, shape: tuple[int, ...],
             where: str) -> np.ndarray:
    """The float32 change one encoded array carries (`side`: its `#scale` or `#index` array)."""
    if spec.name == "topk":
        return sparse_codec.densify(value, side, shape, spec.topk_fraction, where)
    if spec.name in quantized_codec.LEVELS:
        if side is None:
            raise ValidationError(Reason.MALFORMED, f"{where}: {spec.name} needs its {where}{SCALE_SUFFIX}")
        return quantized_codec.dequantize(spec.name, value, side, shape, where)
    delta = np.empty(value.shape, np.float32)
    if spec.name == "fp16":
        if value.dtype != np.float16:
            raise ValidationError(Reason.BAD_DTYPE, f"{where}: fp16 codec, got {value.dtype}")
        np.copyto(delta, value)
        return delta
    if value.dtype != np.int8 or side is None or side.shape != () or not np.isfinite(side):
        raise ValidationError(Reason.MALFORMED, f"{where}: int8 codec needs int8 data and a scale")
    np.multiply(value, np.float32(side), out=delta, dtype=np.float32)
    return delta


def _restored(delta: np.ndarray, base: np.ndarray | None, wanted: np.dtype) -> np.ndarray:
    """`delta + base` in float32 (the base rounded to float32 first), in the dtype `wanted`:
    computed in place in `delta`, so one full-size array is made, not four."""
    if base is not None:
        np.add(delta, base, out=delta, dtype=np.float32)
    return delta if wanted == np.float32 else delta.astype(wanted)
