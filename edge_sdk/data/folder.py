"""Read an ImageFolder directory (one sub-directory of images per class) into [0, 1] pixels.

Images may have any H x W, square or not: all are resized to the requested size (a declared
task's), or to the first image's size. Channels are the requested count, or 1 when every image
is grayscale and 3 otherwise. Pillow is imported only here, when a folder is read.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")
_GRAY_MODES = frozenset({"1", "L", "I", "I;16", "F"})
_MODES = {1: "L", 3: "RGB", 4: "RGBA"}


def read_image_folder(
    root: Path, channels: int | None = None, size: tuple[int, int] | None = None
) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """(x01 float32 [N, C, H, W], the class folder name of each image [N], the class folders sorted).

    `channels` (1, 3 or 4) and `size` (H, W) fix the result's shape; without them they are
    inferred as the module says.
    """
    try:
        from PIL import Image
    except ImportError as exc:
        raise ImportError("reading an image folder needs Pillow: pip install pillow") from exc

    if channels is not None and channels not in _MODES:
        raise ValueError(f"{root}: images of an ImageFolder have 1, 3 or 4 channels, the task says {channels}")
    class_dirs = sorted(d for d in root.iterdir() if d.is_dir())
    files = [(f, d.name) for d in class_dirs for f in sorted(d.iterdir()) if f.suffix.lower() in IMAGE_SUFFIXES]
    if not files:
        raise ValueError(f"{root}: no {'/'.join(IMAGE_SUFFIXES)} images in class folders")
    images = []
    for f, _ in files:
        with Image.open(f) as im:
            images.append(im.copy())
    if channels is None:
        channels = 1 if all(im.mode in _GRAY_MODES for im in images) else 3
    height, width = size if size is not None else (images[0].height, images[0].width)
    arrays = []
    for im in images:
        im = im.convert(_MODES[channels])
        if im.size != (width, height):
            im = im.resize((width, height), Image.Resampling.BILINEAR)
        arrays.append(np.asarray(im, dtype=np.uint8).reshape(height, width, channels))
    x01 = np.stack(arrays).transpose(0, 3, 1, 2).astype(np.float32) / np.float32(255)
    logger.info("read %d images of %dx%dx%d in %d classes from %s", len(files), channels, height, width,
                len(class_dirs), root)
    return x01, np.asarray([name for _, name in files]), tuple(d.name for d in class_dirs)
