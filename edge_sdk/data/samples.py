"""Raw arrays from a user -> samples laid out as a task kind wants them, and integer labels.

Layouts by the rank of `x` (N samples first):
- 2-D [N, D]: feature vectors (`features`).
- 3-D: grayscale images [N, H, W] (`image`, one channel) unless the kind is declared `signal`
  (then [N, C, L]) or `features` (then flattened). Integer arrays are always pixels; a float 3-D
  array read as images must lie in [0, 1], so a signal array mistaken for images is refused with
  a hint to declare its kind.
- 4-D: images [N, C, H, W] or [N, H, W, C] (channels last when axis 1 is not 1, 3 or 4 channels
  but the last axis is, or when a declared input shape says so).
A declared input shape must match (feature vectors and signals may be reshaped to it when the
sizes agree). Images end as float32 pixels in [0, 1] (integers are read as 0..255); signals and
feature vectors as float32 values, which must be finite. Numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from edge_sdk.data.task import TASK_KINDS

_CHANNEL_COUNTS = (1, 3, 4)


def samples_kind(x: np.ndarray, kind: str | None) -> str:
    """The task kind of raw `x` (N first): `kind` when declared, otherwise by rank."""
    if kind is not None:
        if kind not in TASK_KINDS:
            raise ValueError(f"kind must be one of {', '.join(TASK_KINDS)}, got {kind!r}")
        return kind
    if x.ndim == 2:
        return "features"
    if x.ndim in (3, 4):
        return "image"
    raise ValueError(f"x must be [N, D] features, [N, C, L] signals or [N, H, W] / [N, C, H, W] / "
                     f"[N, H, W, C] images, got shape {list(x.shape)}")


def arrange_samples(x: np.ndarray, kind: str | None = None, input_shape: Sequence[int] | None = None,
                    *, where: str = "x") -> tuple[np.ndarray, str]:
    """(float32 samples [N, *input_shape], kind) from raw `x`, by the rules of this module.

    `where` names the source in error messages (a path, or "x").
    """
    x = np.asarray(x)
    if x.ndim < 2 or x.shape[0] == 0:
        raise ValueError(f"{where}: x must hold at least one sample with a sample axis, got shape {list(x.shape)}")
    if not (np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)):
        raise ValueError(f"{where}: x must be integers or floats, got dtype {x.dtype}")
    kind = samples_kind(x, kind)
    shape = tuple(int(s) for s in input_shape) if input_shape is not None else None
    if kind == "image":
        return _as_pixels(_images_nchw(x, shape, where), where), kind
    values = _reshaped(x, kind, shape, where).astype(np.float32)
    if not np.isfinite(values).all():
        position = [int(i) for i in np.argwhere(~np.isfinite(values))[0]]
        raise ValueError(f"{where}: x{position} is not a finite number")
    return values, kind


def _reshaped(x: np.ndarray, kind: str, shape: tuple[int, ...] | None, where: str) -> np.ndarray:
    rank = 1 if kind == "features" else 2
    if shape is not None and x.shape[1:] != shape:
        if math.prod(x.shape[1:]) != math.prod(shape):
            raise ValueError(f"{where}: samples of shape {list(x.shape[1:])} do not fit the task's input shape "
                             f"{list(shape)}")
        return x.reshape(x.shape[0], *shape)
    if kind == "features":
        return x.reshape(x.shape[0], -1)
    if x.ndim != rank + 1:
        raise ValueError(f"{where}: signals are [N, C, L] (channels x length), got shape {list(x.shape)}")
    return x


def _images_nchw(x: np.ndarray, shape: tuple[int, ...] | None, where: str) -> np.ndarray:
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4:
        raise ValueError(f"{where}: images are [N, H, W], [N, C, H, W] or [N, H, W, C], got shape {list(x.shape)}")
    if shape is not None:
        if x.shape[1:] == shape:
            return x
        if x.shape[1:] == (shape[1], shape[2], shape[0]):
            return x.transpose(0, 3, 1, 2)
        raise ValueError(f"{where}: images must be [C, H, W] = {tuple(shape)} (or channels last), "
                         f"got {tuple(x.shape[1:])}")
    if x.shape[1] not in _CHANNEL_COUNTS and x.shape[3] in _CHANNEL_COUNTS:
        return x.transpose(0, 3, 1, 2)
    if x.shape[1] not in _CHANNEL_COUNTS:
        raise ValueError(f"{where}: images need 1, 3 or 4 channels first or last, got shape {list(x.shape)}")
    return x


def _as_pixels(x: np.ndarray, where: str) -> np.ndarray:
    if np.issubdtype(x.dtype, np.integer):
        if x.min() < 0 or x.max() > 255:
            raise ValueError(f"{where}: integer pixels must lie in 0..255")
        return x.astype(np.float32) / np.float32(255)
    if not np.isfinite(x).all() or x.min() < 0 or x.max() > 1:
        raise ValueError(f"{where}: float images must lie in [0, 1]; a 3-D x of floats is read as grayscale "
                         "images [N, H, W]: for signals [N, C, L] declare kind = 'signal' (a [task] table, "
                         "or a `kind` entry in the .npz)")
    return x.astype(np.float32)


def _label_order(values: np.ndarray) -> list:
    """Distinct label values, sorted numerically when all are numbers, as text otherwise."""
    distinct = list(dict.fromkeys(str(v) for v in values.tolist()))
    try:
        return sorted(distinct, key=float)
    except ValueError:
        return sorted(distinct)


def encode_labels(y: np.ndarray, class_names: Sequence[str] | None = None, *, where: str = "y",
                  count: int | None = None) -> tuple[np.ndarray, tuple[str, ...]]:
    """(labels int64 [N], class names) from integer class indices or from class names.

    Integer labels (and whole-number floats) are indices (names "0".."max" unless given); other
    labels are names, mapped to the given class names (or to an integer index below their count),
    or, without names, to their distinct values sorted. `count` is the expected number of labels.
    """
    y = np.asarray(y)
    if y.ndim != 1 or (count is not None and y.shape[0] != count):
        raise ValueError(f"{where}: y must be {count if count is not None else 'N'} labels, got shape {list(y.shape)}")
    if np.issubdtype(y.dtype, np.floating) and np.isfinite(y).all() and (y == np.round(y)).all():
        y = y.astype(np.int64)  # whole-number floats are class indices
    if np.issubdtype(y.dtype, np.integer):
        if y.size and y.min() < 0:
            raise ValueError(f"{where}: integer labels must be non-negative, got {int(y.min())}")
        names = tuple(class_names) if class_names is not None else tuple(
            str(i) for i in range(int(y.max()) + 1 if y.size else 0))
        if y.size and y.max() >= len(names):
            raise ValueError(f"{where}: label {int(y.max())} out of range for {len(names)} classes")
        return y.astype(np.int64), names
    text = np.asarray([str(v) for v in y.tolist()])
    names = tuple(class_names) if class_names is not None else tuple(_label_order(text))
    index = {name: i for i, name in enumerate(names)}
    labels = np.empty(text.size, dtype=np.int64)
    for row, value in enumerate(text.tolist()):
        if value in index:
            labels[row] = index[value]
        elif value.isdigit() and int(value) < len(names):
            labels[row] = int(value)
        else:
            raise ValueError(f"{where}: label {value!r} (sample {row}) is not one of the classes {list(names)}")
    return labels, names
