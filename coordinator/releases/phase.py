"""The release phase: after training, the representation goes out to the fleet.

After training, an algorithm whose global state holds a whole body (RepPer; any algorithm on
request) has that body exported to ONNX from the state arrays the coordinator holds in memory
(`export` never reads a checkpoint, nor imports the coordinator). The coordinator publishes a
small retained manifest (sha256, size, metadata), so devices that join later still see it, and
sends the bytes to each device that asks (FETCH), chunked, on the device's own topic.

What the phase gathers from devices goes through one interface, a `Pool`: each device's share
arrives in an EVAL_RES, is checked, then added; the pooled result goes on. Under secure
aggregation the coordinator sees only the sum of the shares (edge_sdk/secagg/pools.py), which
the pool takes whole (`add_sum`). Two pools exist:
- `StatisticsPool`: algorithms that share the body but keep its BatchNorm statistics personal
  (FedAvg, FedPer, FedRep, ...) release on request (`--release`); the trainers first compute the
  statistics of the global body on their training data, pooled into what the export needs
  (passed to the export, and saved in the run folder, `RunFolder.body_statistics`, for a later
  `edgepfl export`).
- `PrototypePool`: weak devices report class counts and feature means, pooled, weighted by
  counts, into global prototypes that go out with the final evaluation.
`ReleasePhase` runs these steps in order; the coordinator only says how to ask devices
(`gather`) and publishes what the phase produces.
"""

from __future__ import annotations

import hashlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from edge_sdk.models import ModelSpec
from edge_sdk.protocol import PROTOTYPES, STATISTICS, ArrayGroup, Reason, ValidationError
from edge_sdk.secagg.pools import decode_prototypes, decode_statistics, prototypes_length, statistics_length

from ..run.folder import RunFolder
from .representation import representation, run_samples

log = logging.getLogger(__name__)

CHECK_SAMPLES = 256
"""Real samples of the run's data the released body is checked against PyTorch on."""


class Pool(ABC):
    """Devices' shares of something the release needs, pooled from their EVAL_RES replies."""

    group: ClassVar[str]
    """The EVAL_RES array group that carries a device's share."""
    phase: ClassVar[str]
    """The EVALUATE phase that asks the devices for it."""
    required: ClassVar[bool]
    """Whether a reply without the group is refused (otherwise it is evaluated, not pooled)."""
    evaluates: ClassVar[bool]
    """Whether the replies are evaluations too (they carry an accuracy)."""

    devices: int
    """Devices pooled so far."""

    @abstractmethod
    def check(self, arrays: ArrayGroup, registered_examples: int) -> None:
        """Raise `ValidationError` for a share that must not be pooled."""

    @abstractmethod
    def add(self, arrays: ArrayGroup, registered_examples: int) -> None:
        """Pool one checked share from a device registered with `registered_examples`."""

    @abstractmethod
    def result(self) -> ArrayGroup:
        """What was pooled."""

    @abstractmethod
    def secure_length(self) -> int:
        """Elements of one device's share as a vector for the secure sum (edge_sdk/secagg/pools.py)."""

    @abstractmethod
    def add_sum(self, total: np.ndarray, devices: int, largest: int) -> None:
        """Pool the secure sum `total` of `devices` devices' shares, weighted against `largest`."""


@dataclass(frozen=True)
class Release:
    path: Path
    data: bytes
    sha256: str
    metadata: dict[str, Any]
    version: int | None = None
    """Its number among the run's releases (`coordinator.releases.store`), once kept there."""

    def manifest(self) -> dict[str, Any]:
        manifest = {"sha256": self.sha256, "size": len(self.data), "format": "onnx", "metadata": self.metadata}
        return manifest if self.version is None else manifest | {"version": self.version}

    def artifact(self) -> dict[str, ArrayGroup]:
        return {"artifact": {"onnx": np.frombuffer(self.data, dtype=np.uint8)}}


def export_release(folder: RunFolder, state: Mapping[str, ArrayGroup], config: Mapping[str, Any], *, run_id: str,
                   round_: int, statistics: ArrayGroup | None = None, model: ModelSpec | None = None) -> Release:
    """Export the run's global body, from the global `state` and pooled `statistics` (`body.*`
    BatchNorm buffers) held in memory, to `folder.release` (fp32, parity checked on
    CHECK_SAMPLES real samples of the run's data). `config` is the run's configuration as its
    checkpoint records it; `model` the run's model spec or factory."""
    from export import export_body

    loaded = representation(state, config, run_id=run_id, round_=round_, statistics=statistics, model=model)
    samples, _ = run_samples(config, None, CHECK_SAMPLES)
    path = folder.release
    summary = export_body(loaded.body, loaded.input_shape, path, metadata=loaded.metadata, samples=samples,
                          seed=int(config.get("seed", 0)))
    data = path.read_bytes()
    release = Release(path, data, hashlib.sha256(data).hexdigest(), summary["metadata"])
    log.info("released %s (%d bytes, sha256 %s)", path, len(data), release.sha256[:12])
    return release


class PrototypePool(Pool):
    """Global class means from devices' (counts [C], means [C, d]), weighted by the counts.
    Weak devices send them along with their evaluation; one that sends none is not pooled."""

    group, phase, required, evaluates = PROTOTYPES, PROTOTYPES, False, True

    def __init__(self, num_classes: int, dim: int):
        self.num_classes, self.dim = num_classes, dim
        self.counts = np.zeros(num_classes, dtype=np.int64)
        self._sums = np.zeros((num_classes, dim), dtype=np.float64)
        self.devices = 0

    def check(self, arrays: ArrayGroup, registered_examples: int) -> None:
        """Reject prototypes of the wrong shape, non-finite means or implausible counts."""
        counts, means = arrays.get("counts"), arrays.get("means")
        if set(arrays) != {"counts", "means"} or counts is None or means is None:
            raise ValidationError(Reason.UNEXPECTED_ARRAYS,
                                  f"prototypes must be counts and means, got {sorted(arrays)}")
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

    def add(self, arrays: ArrayGroup, registered_examples: int) -> None:
        counts = arrays["counts"].astype(np.int64)
        self.counts += counts
        self._sums += counts[:, None] * arrays["means"].astype(np.float64)
        self.devices += 1

    def result(self) -> ArrayGroup:
        means = self._sums / np.maximum(self.counts, 1)[:, None]
        return {"counts": self.counts.copy(), "means": means.astype(np.float32)}

    def secure_length(self) -> int:
        return prototypes_length(self.num_classes, self.dim)

    def add_sum(self, total: np.ndarray, devices: int, largest: int) -> None:
        pooled = decode_prototypes(total, self.num_classes, self.dim, largest)
        self.counts += pooled["counts"]
        self._sums += pooled["counts"][:, None] * pooled["means"].astype(np.float64)
        self.devices += devices


_MEAN, _VAR, _COUNT = "running_mean", "running_var", "num_batches_tracked"


class StatisticsPool(Pool):
    """The global body's BatchNorm statistics pooled from devices' (weighted by their examples).

    Means are averaged; a variance is pooled as E[x^2] - E[x]^2 over the union of the devices'
    data (each device's variance plus the spread of its mean around the pooled one), exact for
    the first layer and the usual approximation for deeper ones. `num_batches_tracked` (unused in
    inference) keeps the largest count (0 when pooled securely). The trainers send the statistics
    instead of an evaluation."""

    group, phase, required, evaluates = STATISTICS, STATISTICS, True, False

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self.shapes = shapes
        self._sums: dict[str, np.ndarray] = {}
        self._weight = 0.0
        self._secure: ArrayGroup | None = None
        self.devices = 0

    def check(self, arrays: ArrayGroup, registered_examples: int) -> None:
        """Reject statistics with other keys or shapes, non-finite values or negative variances."""
        if set(arrays) != set(self.shapes):
            raise ValidationError(Reason.UNEXPECTED_ARRAYS,
                                  f"statistics must be the body's {len(self.shapes)} BatchNorm buffers, "
                                  f"got {len(arrays)} arrays ({sorted(set(arrays) ^ set(self.shapes))[:3]} differ)")
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

    def add(self, arrays: ArrayGroup, registered_examples: int) -> None:
        weight = float(registered_examples)
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

    def secure_length(self) -> int:
        return statistics_length(self.shapes)

    def add_sum(self, total: np.ndarray, devices: int, largest: int) -> None:
        """The pooled statistics, whole (a secure sum is the only share of a secure release)."""
        self._secure = decode_statistics(total, self.shapes)
        self.devices = devices

    def result(self) -> ArrayGroup:
        if self._secure is not None:
            return dict(self._secure)
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


class ReleasePhase:
    """The steps of a release, in order: pool the body's statistics where the export needs
    them, export, then pool the weak devices' prototypes for the final evaluation.

    The body is the global `state` the coordinator holds after round `round_`, of the run whose
    configuration is `config` (as its checkpoint records it) and whose model is `model`.
    `gather(targets, pool)` asks the `targets` for the pool's phase and pools their replies (the
    coordinator's evaluation round); publishing and the final evaluation stay with the caller."""

    def __init__(self, folder: RunFolder, num_classes: int, gather: Callable[[list[str], Pool], None], *,
                 state: Mapping[str, ArrayGroup], config: Mapping[str, Any], model: ModelSpec, run_id: str,
                 round_: int):
        self.folder = folder
        self.num_classes = num_classes
        self.gather = gather
        self.state, self.config, self.model = state, config, model
        self.run_id, self.round = run_id, round_
        self.statistics: ArrayGroup = {}

    def pool_body_statistics(self, trainers: list[str]) -> None:
        """For an algorithm that keeps BatchNorm statistics personal: the trainers compute those
        of the global body on their training data; pooled, they go to the export and are saved
        for a later `edgepfl export`."""
        from .representation import RepresentationError, body_statistics_needed, save_body_statistics

        needed = body_statistics_needed(self.state, self.config, run_id=self.run_id, model=self.model)
        if not needed:
            return
        pool = StatisticsPool(needed)
        self.gather(trainers, pool)
        if not pool.devices:
            raise RepresentationError("no trainer sent the global body's BatchNorm statistics: nothing to release")
        self.statistics = pool.result()
        path = save_body_statistics(self.folder, self.round, self.statistics)
        log.info("BatchNorm statistics of the global body pooled from %d devices: %s", pool.devices, path)

    def export(self) -> Release:
        """The global body with the pooled statistics, exported."""
        return export_release(self.folder, self.state, self.config, run_id=self.run_id, round_=self.round,
                              statistics=self.statistics, model=self.model)

    def prototypes(self, lite: list[str], release: Release) -> dict[str, ArrayGroup]:
        """The weak devices' class prototypes pooled, as the groups to send with the final
        evaluation (none when no weak device sent any)."""
        if not lite:
            return {}
        pool = PrototypePool(self.num_classes, int(release.metadata["feature_dim"]))
        self.gather(lite, pool)
        if not pool.devices:
            return {}
        log.info("global prototypes pooled from %d devices go out with the final evaluation", pool.devices)
        return {PROTOTYPES: pool.result()}
