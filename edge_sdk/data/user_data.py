"""A user's own data: read an `.npz`, a CSV or an ImageFolder, infer its task, load it as a pool.

- `.npz`: arrays `x` and `y`; optionally `kind` ("image", "signal" or "features", which settles
  how a 3-D `x` is read, see `samples.py`) and `class_names` (strings, one per class index).
- `.csv`: a header row, a label column (see `tabular.py`), float features.
- a directory: an ImageFolder (see `folder.py`).
The inferred task takes its shape and kind from the samples, its classes from the labels (class
folders, sorted label values, or indices 0..max) and its mean and std from the data: per channel
for images and signals, per feature for feature vectors (a constant one gets std 1).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_sdk.data.datasets import Dataset
from edge_sdk.data.folder import read_image_folder
from edge_sdk.data.samples import arrange_samples, encode_labels
from edge_sdk.data.tabular import read_csv
from edge_sdk.data.task import TaskSpec

logger = logging.getLogger(__name__)

CONSTANT_STD = 1e-6
"""A channel or feature whose std is at most this is constant: it gets std 1 (no scaling)."""


@dataclass(frozen=True)
class UserData:
    """Samples laid out for their kind (images in [0, 1], not normalized), labels, class names."""

    x: np.ndarray
    y: np.ndarray
    kind: str
    class_names: tuple[str, ...]


def read_user_data(path: str | Path, *, kind: str | None = None, input_shape: Sequence[int] | None = None,
                   class_names: Sequence[str] | None = None, label_column: str | None = None) -> UserData:
    """Read `path` (.npz, .csv or an ImageFolder directory), shaped by what is declared, if anything."""
    path = Path(path).expanduser()
    if path.is_dir():
        return _read_folder(path, kind, input_shape, class_names)
    if not path.is_file():
        raise FileNotFoundError(f"no such file or directory: {path}")
    suffix = path.suffix.lower()
    if suffix == ".npz":
        return _read_npz(path, kind, input_shape, class_names)
    if suffix == ".csv":
        values, labels, _ = read_csv(path, label_column)
        x, kind = arrange_samples(values, kind or "features", input_shape, where=str(path))
        y, names = encode_labels(labels, class_names, where=str(path), count=x.shape[0])
        return UserData(x, y, kind, names)
    raise ValueError(f"{path}: unknown data format {suffix!r}; use an .npz (x, y), a .csv with a label column, "
                     "or an ImageFolder directory")


def _read_folder(path: Path, kind: str | None, input_shape: Sequence[int] | None,
                 class_names: Sequence[str] | None) -> UserData:
    if kind not in (None, "image"):
        raise ValueError(f"{path}: an ImageFolder directory holds images, the task's kind is {kind!r}")
    channels, size = (input_shape[0], (input_shape[1], input_shape[2])) if input_shape is not None else (None, None)
    x01, folders, found = read_image_folder(path, channels, size)
    y, names = encode_labels(folders, class_names if class_names is not None else found, where=str(path))
    return UserData(x01, y, "image", names)


def _read_npz(path: Path, kind: str | None, input_shape: Sequence[int] | None,
              class_names: Sequence[str] | None) -> UserData:
    with np.load(path, allow_pickle=False) as archive:
        missing = {"x", "y"} - set(archive.files)
        if missing:
            raise ValueError(f"{path}: missing arrays {sorted(missing)} (need 'x' and 'y')")
        x, y = archive["x"], archive["y"]
        stored_kind = str(archive["kind"]) if "kind" in archive.files else None
        if class_names is None and "class_names" in archive.files:
            class_names = tuple(str(c) for c in archive["class_names"].tolist())
    if kind is not None and stored_kind is not None and kind != stored_kind:
        raise ValueError(f"{path}: its `kind` entry says {stored_kind!r}, the task {kind!r}")
    x, kind = arrange_samples(x, kind or stored_kind, input_shape, where=str(path))
    y, names = encode_labels(y, class_names, where=str(path), count=x.shape[0])
    return UserData(x, y, kind, names)


def infer_task(name: str, data: UserData) -> TaskSpec:
    """The task of `data`: its kind and shape, its classes, its mean and std (see the module)."""
    axes = (0,) if data.kind == "features" else (0, *range(2, data.x.ndim))
    mean = data.x.mean(axis=axes, dtype=np.float64)
    std = data.x.std(axis=axes, dtype=np.float64)
    return TaskSpec(name=name, kind=data.kind, input_shape=tuple(int(s) for s in data.x.shape[1:]),
                    num_classes=len(data.class_names), class_names=data.class_names,
                    mean=tuple(float(m) for m in mean), std=tuple(float(s) if s > CONSTANT_STD else 1.0 for s in std))


def samples_for_task(data: UserData, task: TaskSpec, where: str) -> UserData:
    """`data` checked against `task` (kind, shape, labels within its classes)."""
    if data.kind != task.kind or data.x.shape[1:] != task.input_shape:
        raise ValueError(f"{where}: {data.kind} samples of shape {list(data.x.shape[1:])}, task {task.name!r} "
                         f"takes {task.kind} samples of shape {list(task.input_shape)}")
    if data.y.size and data.y.max() >= task.num_classes:
        raise ValueError(f"{where}: label {int(data.y.max())} out of range for {task.name} "
                         f"({task.num_classes} classes)")
    return data


_cache: dict[tuple, Dataset] = {}
_cache_lock = threading.Lock()


def load_user_dataset(path: str | Path, task: TaskSpec, *, label_column: str | None = None) -> Dataset:
    """The normalized pool of a user's data file for `task` (read once per process per file version).

    Images are resized to the task's (folders) or must match it; labels must lie in its classes.
    The cached arrays are read-only, as `load_dataset`'s.
    """
    path = Path(path).expanduser()
    stat = path.stat() if path.exists() else None
    key = (os.path.abspath(path), stat.st_mtime_ns if stat else None, task, label_column)
    with _cache_lock:
        if key not in _cache:
            data = read_user_data(path, kind=task.kind, input_shape=task.input_shape,
                                  class_names=task.class_names, label_column=label_column)
            data = samples_for_task(data, task, str(path))
            x = task.normalize(data.x)
            y = data.y
            x.setflags(write=False)
            y.setflags(write=False)
            _cache[key] = Dataset(x=x, y=y, task=task)
            logger.info("loaded %s from %s: %d examples of shape %s", task.name, path, len(y), x.shape[1:])
        return _cache[key]


def dataset_from_arrays(x: np.ndarray, y: np.ndarray, task: TaskSpec | None = None, *, kind: str | None = None,
                        class_names: Sequence[str] | None = None, name: str = "arrays") -> Dataset:
    """A normalized pool from numpy arrays laid out as in a user's .npz (see `samples.py`).

    With `task` the arrays must fit it; otherwise the task is inferred (named `name`; `kind`
    settles a 3-D `x`, `class_names` names the label indices). The arrays are copied.
    """
    if task is not None:
        samples, found = arrange_samples(x, task.kind, task.input_shape)
        labels, names = encode_labels(y, task.class_names, count=samples.shape[0])
        data = samples_for_task(UserData(samples, labels, found, names), task, "arrays")
    else:
        samples, found = arrange_samples(x, kind)
        labels, names = encode_labels(y, class_names, count=samples.shape[0])
        data = UserData(samples, labels, found, names)
        task = infer_task(name, data)
    return Dataset(x=task.normalize(data.x), y=data.y, task=task)
