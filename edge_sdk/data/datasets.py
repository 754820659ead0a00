"""The built-in tasks a federation can use, and the loader of their shared pools.

The pool is the official train and test sets concatenated (as PFLlib does); every device
partitions the same pool with the federation seed. Arrays are numpy: `x` float32
[N, *task.input_shape] normalized with the task's mean/std, `y` int64 [N]. Only numpy is needed
at import time; scikit-learn and torchvision are imported inside the loaders that use them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_sdk.data.idx import read_idx
from edge_sdk.data.synthetic import VIBRATION_AXES, VIBRATION_CLASSES, VIBRATION_LENGTH, vibration_windows
from edge_sdk.data.task import TaskSpec

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


@dataclass
class Dataset:
    """A pool of normalized samples `x` [N, *task.input_shape] float32 and labels `y` [N] int64.

    Pools returned by `load_dataset` are shared by every caller in the process, so their arrays
    are read-only; index them (which copies) before changing anything.
    """

    x: np.ndarray
    y: np.ndarray
    task: TaskSpec


def _numbered(count: int) -> tuple[str, ...]:
    return tuple(str(i) for i in range(count))


def _image(name: str, channels: int, size: int, mean: tuple[float, ...], std: tuple[float, ...],
           class_names: tuple[str, ...]) -> TaskSpec:
    return TaskSpec(name, "image", (channels, size, size), len(class_names), class_names, mean, std)


_FASHION = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
            "Ankle boot")
_CIFAR10 = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")

# Pool mean and (population) std per feature of scikit-learn's bundled tabular sets, and per axis
# of the synthetic vibration pool; tests/unit/test_data.py recomputes them from the data.
_BREAST_CANCER_MEAN = (
    14.12729, 19.28965, 91.96903, 654.8891, 0.09636028, 0.104341, 0.08879932, 0.04891915, 0.1811619,
    0.06279761, 0.4051721, 1.216853, 2.866059, 40.33708, 0.007040979, 0.02547814, 0.03189372, 0.01179614,
    0.0205423, 0.003794904, 16.26919, 25.67722, 107.2612, 880.5831, 0.1323686, 0.254265, 0.2721885,
    0.1146062, 0.2900756, 0.08394582)
_BREAST_CANCER_STD = (
    3.520951, 4.297255, 24.27762, 351.6048, 0.01405176, 0.05276633, 0.07964973, 0.03876873, 0.02739018,
    0.007054156, 0.2770689, 0.5511634, 2.020077, 45.45101, 0.002999878, 0.01789244, 0.03015952,
    0.006164861, 0.008259104, 0.002643745, 4.828993, 6.140854, 33.573, 568.8565, 0.02281236, 0.1571982,
    0.2084409, 0.06567455, 0.06181308, 0.01804539)
_WINE_MEAN = (13.00062, 2.336348, 2.366517, 19.49494, 99.74157, 2.295112, 2.02927, 0.3618539, 1.590899,
              5.05809, 0.9574494, 2.611685, 746.8933)
_WINE_STD = (0.8095429, 1.114004, 0.2735723, 3.33017, 14.24231, 0.6240906, 0.996049, 0.1241033, 0.5707488,
             2.311765, 0.2279286, 0.7079933, 314.0217)
_VIBRATION_PER_CLASS = 500
_VIBRATION_SEED = 0
"""The built-in synthetic pool: 500 windows per class from seed 0 (the same on every device)."""

BUILTIN_TASKS: dict[str, TaskSpec] = {
    task.name: task
    for task in (
        # Mean/std of scikit-learn's digits after scaling the 0..16 pixel values to [0, 1].
        _image("digits", 1, 8, (0.3053,), (0.3760,), _numbered(10)),
        _image("fmnist", 1, 28, (0.2860,), (0.3530,), _FASHION),
        _image("mnist", 1, 28, (0.1307,), (0.3081,), _numbered(10)),
        _image("cifar10", 3, 32, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), _CIFAR10),
        # Class names are replaced by torchvision's when the dataset is loaded.
        _image("cifar100", 3, 32, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762), _numbered(100)),
        TaskSpec("breast_cancer", "features", (30,), 2, ("malignant", "benign"), _BREAST_CANCER_MEAN,
                 _BREAST_CANCER_STD),
        TaskSpec("wine", "features", (13,), 3, ("class_0", "class_1", "class_2"), _WINE_MEAN, _WINE_STD),
        TaskSpec("synthetic_vibration", "signal", (VIBRATION_AXES, VIBRATION_LENGTH), len(VIBRATION_CLASSES),
                 VIBRATION_CLASSES, (0.01445527, 0.01016007, 0.003679117), (0.8200255, 0.7498904, 0.6630487)),
    )
}
"""The built-in tasks by name: five image sets, two tabular sets, one synthetic sensor."""

_TORCHVISION_CLASSES = {"mnist": "MNIST", "cifar10": "CIFAR10", "cifar100": "CIFAR100"}

_cache: dict[tuple[str, str | None], Dataset] = {}
_cache_lock = threading.Lock()


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


RawPool = tuple[np.ndarray, np.ndarray, TaskSpec]
"""(raw samples [N, *input_shape] (images in [0, 1]), labels int64 [N], task) before normalization."""


def _load_digits(data_dir: str | None) -> RawPool:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x01 = (bunch.images / 16.0).astype(np.float32)[:, None]
    return x01, bunch.target.astype(np.int64), BUILTIN_TASKS["digits"]


def _sklearn_table(name: str, loader: str) -> RawPool:
    """One of scikit-learn's bundled tabular sets: float32 features [N, D] and labels."""
    import sklearn.datasets

    bunch = getattr(sklearn.datasets, loader)()
    return bunch.data.astype(np.float32), bunch.target.astype(np.int64), BUILTIN_TASKS[name]


def _load_vibration(data_dir: str | None) -> RawPool:
    x, y = vibration_windows(_VIBRATION_PER_CLASS, _VIBRATION_SEED)
    return x, y, BUILTIN_TASKS["synthetic_vibration"]


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


def fmnist_idx_files(data_dir: str | None = None) -> list[Path] | None:
    """The four Fashion-MNIST idx files (`FMNIST_FILES` order, each optionally .gz) from the first
    directory that holds them all: `data_dir` (or its `fashion-mnist/` or `FashionMNIST/raw/`),
    then `SYSTEM_FMNIST_DIRS`; None when none does. The loader reads them from there, and a tool
    that writes a smaller copy (benchmarks/fmnist_subset.py) finds them the same way."""
    for directory in _fmnist_dirs(data_dir):
        files = [_idx_file(directory, base) for base in FMNIST_FILES]
        if all(f is not None for f in files):
            return [f for f in files if f is not None]
    return None


def _load_fmnist(data_dir: str | None) -> RawPool:
    task = BUILTIN_TASKS["fmnist"]
    dirs = _fmnist_dirs(data_dir)
    files = fmnist_idx_files(data_dir)
    if files is not None:
        logger.info("loading fmnist idx files from %s", files[0].parent)
        train_x, train_y, test_x, test_y = (read_idx(f) for f in files)
        raw = np.concatenate([train_x, test_x])
        y = np.concatenate([train_y, test_y]).astype(np.int64)
        return _unit_nchw(raw), y, task
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
    return _unit_nchw(raw), y, task


def _load_torchvision(name: str, data_dir: str | None) -> RawPool:
    class_name = _TORCHVISION_CLASSES[name]
    root = _data_root(data_dir)
    errors: list[str] = []
    for download in (False, True):
        try:
            raw, y, classes = _torchvision_pool(class_name, root, download=download)
        except Exception as exc:  # ImportError, missing files, no network
            errors.append(f"download={download}: {exc!r}")
            continue
        task = dataclasses.replace(BUILTIN_TASKS[name], class_names=classes)
        return _unit_nchw(raw), y, task
    raise DatasetNotFoundError(
        f"{name} not found. Looked with torchvision {class_name}(root={root}): "
        + "; ".join(errors)
        + f". Get it by placing torchvision's {class_name} files under a directory passed as "
        "`--data-dir DIR`, or allow network access so torchvision can download it."
    )


_LOADERS: dict[str, Callable[[str | None], RawPool]] = {
    "digits": _load_digits,
    "fmnist": _load_fmnist,
    "mnist": lambda data_dir: _load_torchvision("mnist", data_dir),
    "cifar10": lambda data_dir: _load_torchvision("cifar10", data_dir),
    "cifar100": lambda data_dir: _load_torchvision("cifar100", data_dir),
    "breast_cancer": lambda data_dir: _sklearn_table("breast_cancer", "load_breast_cancer"),
    "wine": lambda data_dir: _sklearn_table("wine", "load_wine"),
    "synthetic_vibration": _load_vibration,
}


def load_dataset(name: str, data_dir: str | None = None) -> Dataset:
    """Load (once per process) the normalized pool of built-in task `name`: official train + test.

    Results are cached per (name, data_dir) because many virtual devices in one process load
    the same pool; the cached arrays are read-only. Unknown names raise ValueError; a dataset
    that cannot be found raises DatasetNotFoundError explaining where it looked.
    """
    if name not in BUILTIN_TASKS:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(BUILTIN_TASKS)}")
    key = (name, None if data_dir is None else os.path.abspath(os.path.expanduser(data_dir)))
    with _cache_lock:
        if key not in _cache:
            raw, y, task = _LOADERS[name](data_dir)
            x = task.normalize(raw)
            x.setflags(write=False)
            y.setflags(write=False)
            _cache[key] = Dataset(x=x, y=y, task=task)
            logger.info("loaded %s: %d examples of shape %s", name, len(y), x.shape[1:])
        return _cache[key]
