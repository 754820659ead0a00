"""Read a device's own images (an `.npz` file or an ImageFolder directory) into [0, 1] pixels.

The result is checked against a known dataset's metadata, or a metadata record is inferred
from the data, so a device with local data can join a federation without torchvision.
Pillow is imported only when reading an image folder.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from edge_sdk.data.datasets import DatasetMeta

logger = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
_GRAY_MODES = frozenset({"1", "L", "I", "I;16", "F"})


def read_folder(
    path: str | Path, meta: DatasetMeta | None
) -> tuple[np.ndarray, np.ndarray, DatasetMeta]:
    """Read `path` into (x01 float32 [N, C, H, W] in [0, 1], y int64 [N], meta).

    With `meta` the images must match (npz) or are resized to (folders) its shape and labels
    must lie in its classes; without it, a meta is inferred (mean/std from the data).
    """
    path = Path(path)
    if path.is_dir():
        x01, y, class_names = _read_image_folder(path, meta)
    elif path.is_file():
        x01, y = _read_npz(path)
        class_names = None
    else:
        raise FileNotFoundError(f"no such file or directory: {path}")
    if x01.shape[0] == 0:
        raise ValueError(f"{path}: no images")
    if meta is None:
        return x01, y, _infer_meta(path.stem, x01, y, class_names)
    expected = (meta.channels, meta.image_size, meta.image_size)
    if x01.shape[1:] != expected:
        raise ValueError(
            f"{path}: images must be [C, H, W] = {expected} for {meta.name}, got {x01.shape[1:]}"
        )
    if y.max() >= meta.num_classes:
        raise ValueError(
            f"{path}: label {y.max()} out of range for {meta.name} ({meta.num_classes} classes)"
        )
    return x01, y, meta


def _read_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with np.load(path, allow_pickle=False) as archive:
        missing = {"x", "y"} - set(archive.files)
        if missing:
            raise ValueError(f"{path}: missing arrays {sorted(missing)} (need 'x' and 'y')")
        x, y = archive["x"], archive["y"]
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4 and x.shape[1] not in (1, 3) and x.shape[3] in (1, 3):
        x = x.transpose(0, 3, 1, 2)
    elif x.ndim != 4 or x.shape[1] not in (1, 3):
        raise ValueError(
            f"{path}: x must be N,H,W or N,C,H,W or N,H,W,C with 1 or 3 channels, "
            f"got shape {x.shape}"
        )
    if np.issubdtype(x.dtype, np.integer):
        if x.size and (x.min() < 0 or x.max() > 255):
            raise ValueError(f"{path}: integer pixels must lie in 0..255")
        x01 = x.astype(np.float32) / np.float32(255)
    elif np.issubdtype(x.dtype, np.floating):
        if x.size and (x.min() < 0 or x.max() > 1):
            raise ValueError(f"{path}: float pixels must lie in [0, 1]")
        x01 = x.astype(np.float32)
    else:
        raise ValueError(f"{path}: x must be integer (0..255) or float (0..1), got {x.dtype}")
    y = np.asarray(y)
    if y.shape != (x.shape[0],) or not np.issubdtype(y.dtype, np.integer) or (y < 0).any():
        raise ValueError(
            f"{path}: y must be {x.shape[0]} non-negative integer labels, got {y.dtype} {y.shape}"
        )
    return x01, y.astype(np.int64)


def _class_index(name: str, meta: DatasetMeta | None, position: int) -> int:
    """Map a class folder's name to a label: meta's class name, a number, or sorted position."""
    if meta is None:
        return position
    if name in meta.class_names:
        return meta.class_names.index(name)
    if name.isdigit() and int(name) < meta.num_classes:
        return int(name)
    raise ValueError(
        f"class folder {name!r} is not a {meta.name} class; use one of "
        f"{list(meta.class_names)} or a number below {meta.num_classes}"
    )


def _read_image_folder(
    root: Path, meta: DatasetMeta | None
) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    try:
        from PIL import Image
    except ImportError as exc:
        raise ImportError("reading an image folder needs Pillow: pip install pillow") from exc

    class_dirs = sorted(d for d in root.iterdir() if d.is_dir())
    files = [
        (f, _class_index(d.name, meta, position))
        for position, d in enumerate(class_dirs)
        for f in sorted(d.iterdir())
        if f.suffix.lower() in IMAGE_SUFFIXES
    ]
    if not files:
        raise ValueError(f"{root}: no {'/'.join(IMAGE_SUFFIXES)} images in class folders")
    images = []
    for f, _ in files:
        with Image.open(f) as im:
            images.append(im.copy())
    if meta is not None:
        channels, size = meta.channels, (meta.image_size, meta.image_size)
    else:
        channels = 1 if all(im.mode in _GRAY_MODES for im in images) else 3
        size = images[0].size
        if size[0] != size[1] or any(im.size != size for im in images):
            raise ValueError(
                f"{root}: images must share one square size "
                "(pass a dataset name to resize them to it)"
            )
    arrays = []
    for im in images:
        im = im.convert("L" if channels == 1 else "RGB")
        if im.size != size:
            im = im.resize(size, Image.BILINEAR)
        arrays.append(np.asarray(im, dtype=np.uint8).reshape(size[1], size[0], channels))
    x01 = np.stack(arrays).transpose(0, 3, 1, 2).astype(np.float32) / np.float32(255)
    y = np.asarray([label for _, label in files], dtype=np.int64)
    logger.info("read %d images in %d classes from %s", len(y), len(class_dirs), root)
    return x01, y, tuple(d.name for d in class_dirs)


def _infer_meta(
    name: str, x01: np.ndarray, y: np.ndarray, class_names: tuple[str, ...] | None
) -> DatasetMeta:
    channels, height, width = x01.shape[1:]
    if height != width:
        raise ValueError(f"{name}: images must be square, got {height}x{width}")
    if class_names is None:
        class_names = tuple(str(i) for i in range(int(y.max()) + 1))
    std = x01.std(axis=(0, 2, 3))
    return DatasetMeta(
        name=name,
        channels=int(channels),
        image_size=int(height),
        num_classes=len(class_names),
        mean=tuple(float(m) for m in x01.mean(axis=(0, 2, 3))),
        std=tuple(float(s) if s > 1e-6 else 1.0 for s in std),
        class_names=class_names,
    )
