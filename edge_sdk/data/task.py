"""What a sample is: the task description every model factory, device and export is built from.

A task covers the three kinds of input edge fleets bring: images of any H x W x C, 1-D signals
(channels x length) and flat feature vectors. It carries the classes and the normalization
(per channel for images and signals, per feature for feature vectors). The built-in datasets are
tasks of this kind; a user's own data gets one inferred from it, or declared in TOML.
Only the standard library and numpy are needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TASK_KINDS: tuple[str, ...] = ("image", "signal", "features")
"""image: [C, H, W]; signal: [C, L]; features: [D]."""

_RANKS = {"image": 3, "signal": 2, "features": 1}


def kind_of_shape(input_shape: tuple[int, ...] | list[int]) -> str:
    """The kind whose samples have `input_shape`'s rank: [C, H, W] image, [C, L] signal, [D] features."""
    for kind, rank in _RANKS.items():
        if len(input_shape) == rank:
            return kind
    raise ValueError(f"a sample has 1 (features), 2 (signal) or 3 (image) dimensions, got input_shape "
                     f"{list(input_shape)}")


@dataclass(frozen=True)
class TaskSpec:
    """One classification task: the kind and shape of a sample, its classes, its normalization.

    `input_shape` is one sample's shape without the batch axis. `mean` and `std` have one entry
    per channel (images, signals) or per feature (feature vectors).
    """

    name: str
    kind: str
    input_shape: tuple[int, ...]
    num_classes: int
    class_names: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.kind not in TASK_KINDS:
            raise ValueError(f"task {self.name!r}: kind must be one of {', '.join(TASK_KINDS)}, got {self.kind!r}")
        if len(self.input_shape) != _RANKS[self.kind] or any(int(s) < 1 for s in self.input_shape):
            raise ValueError(f"task {self.name!r}: a {self.kind} sample has {_RANKS[self.kind]} positive "
                             f"dimensions, got input_shape {self.input_shape}")
        if self.num_classes < 1 or len(self.class_names) != self.num_classes:
            raise ValueError(f"task {self.name!r}: {self.num_classes} classes but {len(self.class_names)} class names")
        if not len(self.mean) == len(self.std) == self.input_shape[0]:
            raise ValueError(f"task {self.name!r}: mean and std need {self.input_shape[0]} entries (one per "
                             f"{'feature' if self.kind == 'features' else 'channel'}), got {len(self.mean)} and "
                             f"{len(self.std)}")
        if any(not s > 0 for s in self.std):
            raise ValueError(f"task {self.name!r}: every std must be positive")

    @property
    def channels(self) -> int:
        """Input channels of images and signals; the feature count of feature vectors."""
        return self.input_shape[0]

    def _stats_shape(self) -> tuple[int, ...]:
        return (1, self.input_shape[0]) + (1,) * (len(self.input_shape) - 1)

    def normalize(self, x: np.ndarray) -> np.ndarray:
        """Float32 copies of raw samples [N, *input_shape] (images in [0, 1]) normalized."""
        x = np.array(x, dtype=np.float32)
        x -= np.asarray(self.mean, dtype=np.float32).reshape(self._stats_shape())
        x /= np.asarray(self.std, dtype=np.float32).reshape(self._stats_shape())
        return x

    def denormalize(self, x: np.ndarray) -> np.ndarray:
        """Invert `normalize` (float32 copies): back to raw samples, e.g. [0, 1] pixels."""
        out = np.array(x, dtype=np.float32)
        out *= np.asarray(self.std, dtype=np.float32).reshape(self._stats_shape())
        out += np.asarray(self.mean, dtype=np.float32).reshape(self._stats_shape())
        return out

    def to_plain(self) -> dict:
        """A msgpack- and JSON-safe description (ONNX metadata, WELCOME, reports)."""
        return {"name": self.name, "kind": self.kind, "input_shape": list(self.input_shape),
                "num_classes": self.num_classes, "class_names": list(self.class_names),
                "mean": list(self.mean), "std": list(self.std)}

    @classmethod
    def from_plain(cls, value: dict) -> TaskSpec:
        """The inverse of `to_plain`; raises ValueError for a malformed description."""
        try:
            return cls(str(value["name"]), str(value["kind"]), tuple(int(s) for s in value["input_shape"]),
                       int(value["num_classes"]), tuple(str(c) for c in value["class_names"]),
                       tuple(float(m) for m in value["mean"]), tuple(float(s) for s in value["std"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed task description: {exc!r}") from None
