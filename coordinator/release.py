"""The released representation and the global class prototypes.

After training, an algorithm whose global state holds a whole body (RepPer; any algorithm on
request) has that body exported to ONNX from the state arrays the coordinator holds in memory
(`export` never reads a checkpoint, nor imports the coordinator). The coordinator publishes a
small retained manifest (sha256, size, metadata), so devices that join later still see it, and
sends the bytes to each device that asks (FETCH), chunked, on the device's own topic. Weak
devices report class counts and feature means; `PrototypePool` pools them, weighted by counts,
into global prototypes that go out with the final evaluation.

Algorithms that share the body but keep its BatchNorm statistics personal (FedAvg, FedPer,
FedRep, ...) release on request (`--release`): the trainers first compute the statistics of
the global body on their training data, and `StatisticsPool` pools them into what the export
needs (passed to the export, and saved beside the checkpoint for a later `edgepfl export`,
`coordinator.representation.STATISTICS_NAME`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edge_sdk.models import ModelSpec
from edge_sdk.protocol import ArrayGroup, Reason, ValidationError

from .representation import representation, run_samples

log = logging.getLogger(__name__)

PROTOTYPES = "prototypes"
CHECK_SAMPLES = 256
"""Real samples of the run's data the released body is checked against PyTorch on."""


@dataclass(frozen=True)
class Release:
    path: Path
    data: bytes
    sha256: str
    metadata: dict[str, Any]

    def manifest(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "size": len(self.data), "format": "onnx", "metadata": self.metadata}

    def artifact(self) -> dict[str, ArrayGroup]:
        return {"artifact": {"onnx": np.frombuffer(self.data, dtype=np.uint8)}}


def export_release(run_dir: Path, state: Mapping[str, ArrayGroup], config: Mapping[str, Any], *, run_id: str,
                   round_: int, statistics: ArrayGroup | None = None, model: ModelSpec | None = None) -> Release:
    """Export the run's global body, from the global `state` and pooled `statistics` (`body.*`
    BatchNorm buffers) held in memory, to run_dir/release/representation.onnx (fp32, parity
    checked on CHECK_SAMPLES real samples of the run's data). `config` is the run's
    configuration as its checkpoint records it; `model` the run's model spec or factory."""
    from export import export_body

    loaded = representation(state, config, run_id=run_id, round_=round_, statistics=statistics, model=model)
    samples, _ = run_samples(config, None, CHECK_SAMPLES)
    path = run_dir / "release" / "representation.onnx"
    summary = export_body(loaded.body, loaded.input_shape, path, metadata=loaded.metadata, samples=samples,
                          seed=int(config.get("seed", 0)))
    data = path.read_bytes()
    release = Release(path, data, hashlib.sha256(data).hexdigest(), summary["metadata"])
    log.info("released %s (%d bytes, sha256 %s)", path, len(data), release.sha256[:12])
    return release


class PrototypePool:
    """Global class means from devices' (counts [C], means [C, d]), weighted by the counts."""

    def __init__(self, num_classes: int, dim: int):
        self.num_classes, self.dim = num_classes, dim
        self.counts = np.zeros(num_classes, dtype=np.int64)
        self._sums = np.zeros((num_classes, dim), dtype=np.float64)
        self.devices = 0

    def check(self, arrays: ArrayGroup, registered_examples: int) -> None:
        """Reject prototypes of the wrong shape, non-finite means or implausible counts."""
        counts, means = arrays.get("counts"), arrays.get("means")
        if set(arrays) != {"counts", "means"} or counts is None or means is None:
            raise ValidationError(Reason.UNEXPECTED_ARRAYS, f"prototypes must be counts and means, got {sorted(arrays)}")
        if counts.dtype.kind not in "iu" or means.dtype.kind != "f":
            raise ValidationError(Reason.BAD_DTYPE, f"counts {counts.dtype}, means {means.dtype}: want int, float")
        if counts.shape != (self.num_classes,):
            raise ValidationError(Reason.BAD_SHAPE, f"counts {list(counts.shape)}, want [{self.num_classes}]")
        if means.shape != (self.num_classes, self.dim):
            raise ValidationError(Reason.BAD_SHAPE,
                                  f"means {means.dtype}{list(means.shape)}, want float[{self.num_classes}, {self.dim}]")
        if not np.isfinite(means).all():
            raise ValidationError(Reason.NON_FINITE, "prototype means are not finite")
        if (counts < 0).any() or int(counts.sum()) > registered_examples:
            raise ValidationError(Reason.MALFORMED, f"class counts sum to {int(counts.sum())} "
                                                    f"for a device with {registered_examples} examples")

    def add(self, arrays: ArrayGroup) -> None:
        counts = arrays["counts"].astype(np.int64)
        self.counts += counts
        self._sums += counts[:, None] * arrays["means"].astype(np.float64)
        self.devices += 1

    def result(self) -> ArrayGroup:
        means = self._sums / np.maximum(self.counts, 1)[:, None]
        return {"counts": self.counts.copy(), "means": means.astype(np.float32)}


_MEAN, _VAR, _COUNT = "running_mean", "running_var", "num_batches_tracked"


class StatisticsPool:
    """The global body's BatchNorm statistics pooled from devices' (weighted by their examples).

    Means are averaged; a variance is pooled as E[x^2] - E[x]^2 over the union of the devices'
    data (each device's variance plus the spread of its mean around the pooled one), exact for
    the first layer and the usual approximation for deeper ones. `num_batches_tracked` (unused in
    inference) keeps the largest count."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self.shapes = shapes
        self._sums: dict[str, np.ndarray] = {}
        self._weight = 0.0
        self.devices = 0

    def check(self, arrays: ArrayGroup) -> None:
        """Reject statistics with other keys or shapes, non-finite values or negative variances."""
        if set(arrays) != set(self.shapes):
            raise ValidationError(Reason.UNEXPECTED_ARRAYS,
                                  f"statistics must be the body's {len(self.shapes)} BatchNorm buffers, got {len(arrays)} "
                                  f"arrays ({sorted(set(arrays) ^ set(self.shapes))[:3]} differ)")
        for key, value in arrays.items():
            if value.shape != self.shapes[key]:
                raise ValidationError(Reason.BAD_SHAPE, f"{key} {list(value.shape)}, want {list(self.shapes[key])}")
            if key.endswith(_COUNT):
                continue
            if value.dtype.kind != "f":
                raise ValidationError(Reason.BAD_DTYPE, f"{key} is {value.dtype}, want float")
            if not np.isfinite(value).all():
                raise ValidationError(Reason.NON_FINITE, f"{key} is not finite")
            if key.endswith(_VAR) and (value < 0).any():
                raise ValidationError(Reason.MALFORMED, f"{key} has negative variances")

    def add(self, arrays: ArrayGroup, weight: float) -> None:
        for key, value in arrays.items():
            if key.endswith(_COUNT):
                self._sums[key] = np.maximum(self._sums.get(key, value), value)
                continue
            value = value.astype(np.float64)
            if key.endswith(_VAR):
                value = value + arrays[key[:-len(_VAR)] + _MEAN].astype(np.float64) ** 2
            self._sums[key] = self._sums.get(key, 0.0) + weight * value
        self._weight += weight
        self.devices += 1

    def result(self) -> ArrayGroup:
        if not self.devices or self._weight <= 0:
            raise ValueError("no statistics were pooled")
        pooled: ArrayGroup = {}
        for key, total in self._sums.items():
            if key.endswith(_COUNT):
                pooled[key] = total
            elif key.endswith(_MEAN):
                pooled[key] = (total / self._weight).astype(np.float32)
        for key, total in self._sums.items():
            if key.endswith(_VAR):
                mean = pooled[key[:-len(_VAR)] + _MEAN].astype(np.float64)
                pooled[key] = np.maximum(total / self._weight - mean ** 2, 0.0).astype(np.float32)
        return pooled
