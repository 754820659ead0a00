"""The image datasets a federation can use: their metadata and the loader for the shared pool.

The pool is the official train and test sets concatenated (as PFLlib does); every device
partitions the same pool with the federation seed. Arrays are numpy: `x` float32 [N, C, H, W]
normalized with the dataset's mean/std, `y` int64 [N]. Only numpy is needed at import time;
scikit-learn and torchvision are imported inside the loaders that use them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_sdk.data.idx import read_idx

logger = logging.getLogger(__name__)

DEFAULT_DATA_DIR = "~/.cache/edgepfl/data"
"""Where torchvision datasets live (and are downloaded to) when no `data_dir` is given."""

SYSTEM_FMNIST_DIRS: tuple[str, ...] = ("/usr/share/datasets/fashion-mnist",)
"""System directories holding the Fashion-MNIST idx files (Debian `dataset-fashion-mnist`)."""

FMNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


class DatasetNotFoundError(FileNotFoundError):
    """A dataset could be found neither on disk nor through a download."""


@dataclass(frozen=True)
class DatasetMeta:
    """What a model and a device need to know about a dataset: shape, classes, normalization."""

    name: str
    channels: int
    image_size: int
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    class_names: tuple[str, ...]


@dataclass
class Dataset:
    """A pool of normalized images `x` [N, C, H, W] float32 and labels `y` [N] int64.

    Pools returned by `load_dataset` are shared by every caller in the process, so their arrays
    are read-only; index them (which copies) before changing anything.
    """

    x: np.ndarray
    y: np.ndarray
    meta: DatasetMeta


def _numbered(count: int) -> tuple[str, ...]:
    return tuple(str(i) for i in range(count))


DATASETS: dict[str, DatasetMeta] = {
    meta.name: meta
    for meta in (
        # Mean/std of scikit-learn's digits after scaling the 0..16 pixel values to [0, 1].
        DatasetMeta("digits", 1, 8, 10, (0.3053,), (0.3760,), _numbered(10)),
        DatasetMeta(
            "fmnist",
            1,
            28,
            10,
            (0.2860,),
            (0.3530,),
            (
                "T-shirt/top",
                "Trouser",
                "Pullover",
                "Dress",
                "Coat",
                "Sandal",
                "Shirt",
                "Sneaker",
                "Bag",
                "Ankle boot",
            ),
        ),
        DatasetMeta("mnist", 1, 28, 10, (0.1307,), (0.3081,), _numbered(10)),
        DatasetMeta(
            "cifar10",
            3,
            32,
            10,
            (0.4914, 0.4822, 0.4465),
            (0.2470, 0.2435, 0.2616),
            (
                "airplane",
                "automobile",
                "bird",
                "cat",
                "deer",
                "dog",
                "frog",
                "horse",
                "ship",
                "truck",
            ),
        ),
        # Class names are replaced by torchvision's when the dataset is loaded.
        DatasetMeta(
            "cifar100",
            3,
            32,
            100,
            (0.5071, 0.4865, 0.4409),
            (0.2673, 0.2564, 0.2762),
            _numbered(100),
        ),
    )
}

_TORCHVISION_CLASSES = {"mnist": "MNIST", "cifar10": "CIFAR10", "cifar100": "CIFAR100"}

_cache: dict[tuple[str, str | None], Dataset] = {}
_cache_lock = threading.Lock()


def _channel_stats(meta: DatasetMeta) -> tuple[np.ndarray, np.ndarray]:
    shape = (1, len(meta.mean), 1, 1)
    mean = np.asarray(meta.mean, dtype=np.float32).reshape(shape)
    std = np.asarray(meta.std, dtype=np.float32).reshape(shape)
    return mean, std


def normalize(x01: np.ndarray, meta: DatasetMeta) -> np.ndarray:
    """Return float32 copies of [N, C, H, W] pixels in [0, 1] normalized with `meta`'s mean/std."""
    mean, std = _channel_stats(meta)
    x = np.array(x01, dtype=np.float32)
    x -= mean
    x /= std
    return x


def denormalize(x: np.ndarray, meta: DatasetMeta) -> np.ndarray:
    """Invert `normalize`: map normalized images back to [0, 1] pixel space (float32 copies).

    Pixel-space transforms (the `domains` feature skew) run on these and are normalized again.
    """
    mean, std = _channel_stats(meta)
    out = np.array(x, dtype=np.float32)
    out *= std
    out += mean
    return out


def _unit_nchw(raw: np.ndarray) -> np.ndarray:
    """uint8 [N, H, W] or [N, H, W, C] pixels -> float32 [N, C, H, W] in [0, 1]."""
    x = raw[:, None] if raw.ndim == 3 else raw.transpose(0, 3, 1, 2)
    return x.astype(np.float32) / np.float32(255)


def _data_root(data_dir: str | None) -> Path:
    return Path(data_dir if data_dir is not None else DEFAULT_DATA_DIR).expanduser()


def _torchvision_pool(
    class_name: str, root: Path, download: bool
) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """Load a torchvision dataset's train+test split as (raw uint8 images, labels, class names)."""
    from torchvision import datasets as tv_datasets

    cls = getattr(tv_datasets, class_name)
    splits = [cls(root=str(root), train=train, download=download) for train in (True, False)]
    x = np.concatenate([np.asarray(s.data) for s in splits])
    y = np.concatenate([np.asarray(s.targets) for s in splits]).astype(np.int64)
    return x, y, tuple(splits[0].classes)


def _load_digits() -> tuple[np.ndarray, np.ndarray, DatasetMeta]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x01 = (bunch.images / 16.0).astype(np.float32)[:, None]
    return x01, bunch.target.astype(np.int64), DATASETS["digits"]


def _idx_file(directory: Path, base: str) -> Path | None:
    for candidate in (directory / base, directory / f"{base}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _fmnist_dirs(data_dir: str | None) -> list[Path]:
    dirs: list[Path] = []
    if data_dir is not None:
        root = Path(data_dir).expanduser()
        dirs += [root, root / "fashion-mnist", root / "FashionMNIST" / "raw"]
    return dirs + [Path(d) for d in SYSTEM_FMNIST_DIRS]


def _load_fmnist(data_dir: str | None) -> tuple[np.ndarray, np.ndarray, DatasetMeta]:
    meta = DATASETS["fmnist"]
    dirs = _fmnist_dirs(data_dir)
    for directory in dirs:
        files = [_idx_file(directory, base) for base in FMNIST_FILES]
        if all(f is not None for f in files):
            logger.info("loading fmnist idx files from %s", directory)
            train_x, train_y, test_x, test_y = (read_idx(f) for f in files)
            raw = np.concatenate([train_x, test_x])
            y = np.concatenate([train_y, test_y]).astype(np.int64)
            return _unit_nchw(raw), y, meta
    root = _data_root(data_dir)
    try:
        raw, y, _ = _torchvision_pool("FashionMNIST", root, download=True)
    except Exception as exc:  # ImportError, no network, corrupt files: all mean "not found"
        looked = "\n".join(f"  - {d}" for d in dirs)
        raise DatasetNotFoundError(
            "Fashion-MNIST not found. Looked for the idx files "
            f"({', '.join(FMNIST_FILES)}, each optionally .gz) in:\n{looked}\n"
            f"  - torchvision FashionMNIST(root={root}, download=True): {exc!r}\n"
            "Get it with `apt-get install dataset-fashion-mnist`, or pass `--data-dir DIR` "
            "with a DIR containing the four idx files, or allow network access so torchvision "
            "can download it."
        ) from exc
    return _unit_nchw(raw), y, meta


def _load_torchvision(
    name: str, data_dir: str | None
) -> tuple[np.ndarray, np.ndarray, DatasetMeta]:
    class_name = _TORCHVISION_CLASSES[name]
    root = _data_root(data_dir)
    errors: list[str] = []
    for download in (False, True):
        try:
            raw, y, classes = _torchvision_pool(class_name, root, download=download)
        except Exception as exc:  # ImportError, missing files, no network
            errors.append(f"download={download}: {exc!r}")
            continue
        meta = dataclasses.replace(DATASETS[name], class_names=classes)
        return _unit_nchw(raw), y, meta
    raise DatasetNotFoundError(
        f"{name} not found. Looked with torchvision {class_name}(root={root}): "
        + "; ".join(errors)
        + f". Get it by placing torchvision's {class_name} files under a directory passed as "
        "`--data-dir DIR`, or allow network access so torchvision can download it."
    )


def load_dataset(name: str, data_dir: str | None = None) -> Dataset:
    """Load (once per process) the normalized pool of dataset `name`: official train + test.

    Results are cached per (name, data_dir) because many virtual devices in one process load
    the same pool; the cached arrays are read-only. Unknown names raise ValueError; a dataset
    that cannot be found raises DatasetNotFoundError explaining where it looked.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASETS)}")
    key = (name, None if data_dir is None else os.path.abspath(os.path.expanduser(data_dir)))
    with _cache_lock:
        if key not in _cache:
            if name == "digits":
                x01, y, meta = _load_digits()
            elif name == "fmnist":
                x01, y, meta = _load_fmnist(data_dir)
            else:
                x01, y, meta = _load_torchvision(name, data_dir)
            x = normalize(x01, meta)
            x.setflags(write=False)
            y.setflags(write=False)
            _cache[key] = Dataset(x=x, y=y, meta=meta)
            logger.info("loaded %s: %d examples of shape %s", name, len(y), x.shape[1:])
        return _cache[key]
