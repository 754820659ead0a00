"""The `q4` and `q2` upload codecs: QSGD-style stochastic quantization of a change, unbiased.

The flattened change is cut into blocks of `BLOCK` values; each block has a float32 scale
s = max |x| of the block and its values go up as signed levels -L..L (L = 7 under q4, 1 under
q2) of the step s / L, rounded up or down at random with the probability that makes the
decoded value's expectation the change itself (so averaging many devices' uploads averages
the rounding away, no error feedback needed). Levels travel as codes level + L, packed 2 (q4)
or 4 (q2) per uint8, least significant bits first. docs/PROTOCOL.md section 8 has the exact rule.
"""

from __future__ import annotations

import numpy as np

from .protocol import Reason, ValidationError

BLOCK = 256
"""Flattened values per scale."""
LEVELS = {"q4": 7, "q2": 1}
"""The largest level of each codec: levels run from -L to L."""
BITS = {"q4": 4, "q2": 2}
"""Bits per packed code."""


def packed_sizes(codec: str, size: int) -> tuple[int, int]:
    """(bytes of packed codes, number of block scales) for an array of `size` values."""
    per_byte = 8 // BITS[codec]
    return -(-size // per_byte), -(-size // BLOCK)


def _steps(scales: np.ndarray, codec: str, size: int) -> np.ndarray:
    """Each value's step s / L (float32), one per flattened value."""
    steps = scales / np.float32(LEVELS[codec])
    return np.repeat(steps, BLOCK)[:size]


def quantize(codec: str, change: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The packed uint8 codes and the float32 block scales of a float32 `change` (any shape),
    with uniforms u in [0, 1) from `rng` (one float32 per value, in flattened order)."""
    flat = change.reshape(-1)
    size, top = flat.size, LEVELS[codec]
    padded = np.zeros(packed_sizes(codec, size)[1] * BLOCK, np.float32)
    magnitude = np.abs(flat)
    padded[:size] = magnitude
    scales = padded.reshape(-1, BLOCK).max(axis=1).astype(np.float32)
    steps = _steps(scales, codec, size)
    ratio = np.divide(magnitude, steps, out=np.zeros(size, np.float32), where=steps > 0)
    low = np.floor(ratio)
    level = low + (rng.random(size, dtype=np.float32) < ratio - low)
    level = np.minimum(level, top).astype(np.int8)
    codes = (np.where(flat < 0, -level, level) + top).astype(np.uint8)
    return _pack(codes, codec), scales


def _pack(codes: np.ndarray, codec: str) -> np.ndarray:
    """Codes (one per uint8) packed `8 // bits` per byte, the first in the least significant bits;
    a last byte's unused slots hold the zero level's code."""
    bits = BITS[codec]
    per_byte = 8 // bits
    flat = np.full(packed_sizes(codec, codes.size)[0] * per_byte, LEVELS[codec], np.uint8)
    flat[:codes.size] = codes
    slots = flat.reshape(-1, per_byte)
    packed = np.zeros(slots.shape[0], np.uint8)
    for position in range(per_byte):
        packed |= slots[:, position] << np.uint8(position * bits)
    return packed


def dequantize(codec: str, packed: np.ndarray, scales: np.ndarray, shape: tuple[int, ...], where: str) -> np.ndarray:
    """The float32 change of `shape` that `packed` and `scales` carry: level x (s / L) per value.
    Raises ValidationError (`malformed`, naming `where`) for wrong dtypes or lengths, a scale
    that is negative or not finite, a code above 2L, or a padding slot not at the zero level."""
    size = int(np.prod(shape, dtype=np.int64))
    want_bytes, want_scales = packed_sizes(codec, size)
    if packed.dtype != np.uint8 or packed.shape != (want_bytes,):
        raise ValidationError(Reason.MALFORMED, f"{where}: {codec} codes must be uint8 of shape [{want_bytes}], got "
                                                f"{packed.dtype} {list(packed.shape)}")
    if scales.dtype != np.float32 or scales.shape != (want_scales,):
        raise ValidationError(Reason.MALFORMED, f"{where}: {codec} scales must be float32 of shape [{want_scales}], "
                                                f"got {scales.dtype} {list(scales.shape)}")
    if not np.all(np.isfinite(scales)) or np.any(scales < 0):
        raise ValidationError(Reason.MALFORMED, f"{where}: {codec} scales must be finite and non-negative")
    bits, top = BITS[codec], LEVELS[codec]
    mask = np.uint8((1 << bits) - 1)
    slots = np.stack([(packed >> np.uint8(p * bits)) & mask for p in range(8 // bits)], axis=1).reshape(-1)
    if np.any(slots > 2 * top):
        raise ValidationError(Reason.MALFORMED, f"{where}: {codec} code above {2 * top}")
    if np.any(slots[size:] != top):
        raise ValidationError(Reason.MALFORMED, f"{where}: {codec} padding must hold the zero level's code {top}")
    levels = slots[:size].astype(np.float32) - np.float32(top)
    return (levels * _steps(scales, codec, size)).reshape(shape)
