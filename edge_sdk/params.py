"""Named arrays and their partition into shared and personal parts (no torch needed).

Personalization is a partition of `state_dict` names by model part (the first dotted segment:
`body.conv1.weight` belongs to part `body`), never substring guessing. Running statistics of
normalization layers are personal unless an algorithm says otherwise.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import overload

import numpy as np

from .protocol import ArrayGroup, Reason, ValidationError

ArraySpec = dict[str, tuple[tuple[int, ...], str]]
"""name -> (shape, dtype name): what a group of arrays must look like."""


def part_of(key: str) -> str:
    return key.split(".", 1)[0]


@dataclass(frozen=True)
class Partition:
    """Which state keys are shared (uploaded, aggregated, broadcast) and which stay on the device."""

    shared: tuple[str, ...]
    personal: tuple[str, ...]

    def split(self, state: Mapping[str, np.ndarray]) -> tuple[ArrayGroup, ArrayGroup]:
        return {k: state[k] for k in self.shared}, {k: state[k] for k in self.personal}


def partition_by_parts(
    keys: Iterable[str], shared_parts: Iterable[str], statistics: Iterable[str] = ()
) -> Partition:
    """Keys of `shared_parts` are shared, except running statistics; everything else is personal."""
    shared_parts, statistics = set(shared_parts), set(statistics)
    shared: list[str] = []
    personal: list[str] = []
    for key in keys:
        (shared if part_of(key) in shared_parts and key not in statistics else personal).append(key)
    return Partition(tuple(shared), tuple(personal))


def spec_of(arrays: Mapping[str, np.ndarray]) -> ArraySpec:
    return {k: (tuple(v.shape), v.dtype.name) for k, v in arrays.items()}


def check_arrays(where: str, arrays: Mapping[str, np.ndarray], expected: ArraySpec) -> None:
    """Names, shapes and dtypes exactly as expected, and every value finite; else ValidationError."""
    if set(arrays) != set(expected):
        missing, extra = sorted(set(expected) - set(arrays)), sorted(set(arrays) - set(expected))
        raise ValidationError(Reason.UNEXPECTED_ARRAYS, f"{where}: missing {missing[:5]}, unexpected {extra[:5]}")
    for key, array in arrays.items():
        shape, dtype = expected[key]
        if array.dtype.name != dtype:
            raise ValidationError(Reason.BAD_DTYPE, f"{where}/{key}: got {array.dtype.name}, want {dtype}")
        if tuple(array.shape) != tuple(shape):
            raise ValidationError(
                Reason.BAD_SHAPE, f"{where}/{key}: got {array.dtype.name}{list(array.shape)}, want {dtype}{list(shape)}"
            )
        if array.dtype.kind == "f" and not all_finite(array):
            raise ValidationError(Reason.NON_FINITE, f"{where}/{key} has non-finite values")


BLOCK = 1 << 16
"""Elements per step of the block-wise array loops: their temporaries stay this small."""


def blocks(size: int, block: int = BLOCK) -> Iterator[slice]:
    """Consecutive slices that cover `range(size)`, `block` elements each (the last shorter)."""
    return (slice(start, min(start + block, size)) for start in range(0, size, block))


@overload
def flat(array: np.ndarray) -> np.ndarray: ...


@overload
def flat(array: None) -> None: ...


@overload
def flat(array: np.ndarray | None) -> np.ndarray | None: ...


def flat(array: np.ndarray | None) -> np.ndarray | None:
    """`array` as a contiguous 1-d array (a view where it already is contiguous); None stays None."""
    return None if array is None else np.ascontiguousarray(array).reshape(-1)


def aligned_reference(base: np.ndarray, value: np.ndarray) -> np.ndarray | None:
    """`base` cut to `value`'s shape when `value` is a leading slice of it (as CD2-pFed's shared
    entries are of the previous round's), `base` itself for equal shapes, else None."""
    if base.shape == value.shape:
        return base
    if base.ndim == value.ndim and all(v <= b for v, b in zip(value.shape, base.shape, strict=True)):
        return base[tuple(slice(0, s) for s in value.shape)]
    return None


def all_finite(array: np.ndarray) -> bool:
    """Whether every value is finite, checked a block at a time: no full-size temporary
    (np.isfinite on a whole 1M-parameter array makes a 1 MB mask).

    A float32 block is settled by its sum of squares (BLAS sdot, single-threaded, several times
    faster than a mask): a NaN or infinity makes it NaN or infinite, so a finite sum proves every
    value finite. Only a block whose sum is not finite, which large finite values can also cause,
    is checked value by value."""
    values = flat(array)
    if values.dtype == np.float32:
        with np.errstate(over="ignore", invalid="ignore"):
            return all(math.isfinite(np.dot(block, block)) or bool(np.isfinite(block).all())
                       for block in aligned_blocks(values))
    return all(np.isfinite(values[part]).all() for part in blocks(values.size))


_block_buffers = threading.local()


def block_buffer(dtype: np.dtype | type, slot: str = "") -> np.ndarray:
    """This thread's buffer of BLOCK elements of `dtype` named `slot`, made once: a block loop
    that needs scratch space takes it here instead of allocating it for every array (a buffer
    of 128 KiB or more is a new mapping each time, coordinator.memory)."""
    name = f"{np.dtype(dtype).str}{slot}"
    buffer = getattr(_block_buffers, name, None)
    if buffer is None:
        buffer = np.empty(BLOCK, dtype)
        setattr(_block_buffers, name, buffer)
    return buffer


def aligned_blocks(values: np.ndarray) -> Iterator[np.ndarray]:
    """The blocks of a 1-d array as aligned arrays: views where it is aligned; else each block
    copied into this thread's block buffer (valid until the next block). Arrays decoded from a
    message start wherever their bytes do, and BLAS cannot read a misaligned one: numpy would
    copy it whole for every call, into a new mapping (coordinator.memory)."""
    if values.flags.aligned:
        yield from (values[part] for part in blocks(values.size))
        return
    buffer = block_buffer(values.dtype, "aligned")
    for part in blocks(values.size):
        block = buffer[: part.stop - part.start]
        np.copyto(block, values[part])
        yield block


def floats_finite(arrays: Mapping[str, np.ndarray]) -> bool:
    """Whether every floating-point array of a group holds only finite values."""
    return all(all_finite(value) for value in arrays.values() if value.dtype.kind == "f")


def nbytes(arrays: Mapping[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in arrays.values())
