"""The released representation and the global class prototypes.

After training, an algorithm whose global state holds a whole body (RepPer; any algorithm on
request) has that body exported to ONNX. The coordinator publishes a small retained manifest
(sha256, size, metadata), so devices that join later still see it, and sends the bytes to each
device that asks (FETCH), chunked, on the device's own topic. Weak devices report class counts
and feature means; `PrototypePool` pools them, weighted by counts, into global prototypes that
go out with the final evaluation.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edge_sdk.protocol import ArrayGroup, Reason, ValidationError

log = logging.getLogger(__name__)

PROTOTYPES = "prototypes"


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


def export_release(run_dir: Path) -> Release:
    """Export the run's representation (from its latest checkpoint) to run_dir/release/."""
    from export.run import export_run

    path = run_dir / "release" / "representation.onnx"
    summary = export_run(run_dir, path)
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
