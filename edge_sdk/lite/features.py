"""Feature extraction with ONNX Runtime: a released representation turns samples into features.

A representation (see `export/`) is an ONNX model with one input `input` (float32
[N, *input_shape]: images [N, C, H, W], signals [N, C, L] or feature vectors [N, D], normalized
as `edge_sdk.data` produces them) and one output `features` (float32 [N, d]);
its `metadata_props` hold JSON-encoded descriptions (input shape, normalization, feature
dimension, class names, provenance). This module needs onnxruntime and numpy, never torch, so
weak devices can run it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from ..data.task import TaskSpec, kind_of_shape

log = logging.getLogger(__name__)

INPUT_NAME = "input"
OUTPUT_NAME = "features"
PREFERRED_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
"""The order "auto" tries, keeping those this onnxruntime build offers."""
EMBED_BATCH = 32
"""Samples per onnxruntime call. ONNX Runtime's CPU arena grows to the largest batch's
activations and keeps them: on 28x28 images a cnn28 body at 256 per call raised the peak RSS by
about 45 MB, at 32 by about 2.5 MB, at no measurable cost in speed (benchmarks/docs/devices.md,
device footprint). Disabling the arena instead measured worse (15-30 MB, varying from run to
run with malloc's fragmentation), so the arena stays on and the batch stays small."""


class RepresentationError(ValueError):
    """A model onnxruntime cannot load, or one without the contract's `input` and `features`."""


def choose_providers(providers: str | Sequence[str] = "auto") -> list[str]:
    """The execution providers to ask for: "auto" picks TensorRT, then CUDA, then the CPU
    among those available; a name or a list of names is taken as given."""
    if providers == "auto":
        available = set(ort.get_available_providers())
        return [name for name in PREFERRED_PROVIDERS if name in available]
    return [providers] if isinstance(providers, str) else list(providers)


def decode_metadata(props: dict[str, str]) -> dict[str, Any]:
    """`metadata_props` with their JSON values decoded (a value that is not JSON stays a string)."""
    decoded: dict[str, Any] = {}
    for key, value in props.items():
        try:
            decoded[key] = json.loads(value)
        except json.JSONDecodeError:
            decoded[key] = value
    return decoded


class FeatureExtractor:
    """An ONNX Runtime session over a representation: `embed(samples) -> features`."""

    def __init__(self, model: bytes | str | Path, providers: str | Sequence[str] = "auto"):
        source = model if isinstance(model, bytes) else str(model)
        try:
            self.session = ort.InferenceSession(source, providers=choose_providers(providers))
        except Exception as exc:  # onnxruntime's binding errors share no base class below Exception
            raise RepresentationError(f"onnxruntime cannot load the representation: {exc}") from exc
        inputs = [i.name for i in self.session.get_inputs()]
        outputs = [o.name for o in self.session.get_outputs()]
        if INPUT_NAME not in inputs or OUTPUT_NAME not in outputs:
            raise RepresentationError(
                f"a representation has input {INPUT_NAME!r} and output {OUTPUT_NAME!r}; "
                f"this model has inputs {inputs} and outputs {outputs}"
            )
        self.metadata: dict[str, Any] = decode_metadata(self.session.get_modelmeta().custom_metadata_map)
        self.providers: list[str] = self.session.get_providers()
        log.info("representation loaded (providers %s, feature_dim %s)", self.providers,
                 self.metadata.get("feature_dim"))

    @property
    def input_shape(self) -> tuple[int, ...] | None:
        """One sample's shape ([C, H, W], [C, L] or [D]) from the metadata, when present."""
        shape = self.metadata.get("input_shape")
        return tuple(int(s) for s in shape) if shape is not None else None

    def task(self, name: str = "release") -> TaskSpec | None:
        """The task the representation was trained on, from its metadata: the `task` entry, or
        else its `input_shape`, `normalization` and `class_names` (the kind by the shape's rank);
        None when the metadata does not say."""
        if isinstance(self.metadata.get("task"), dict):
            return TaskSpec.from_plain(self.metadata["task"])
        shape, normalization = self.input_shape, self.metadata.get("normalization")
        names = self.metadata.get("class_names")
        if shape is None or not isinstance(normalization, dict) or not names:
            return None
        return TaskSpec(name, kind_of_shape(shape), shape, len(names), tuple(str(c) for c in names),
                        tuple(float(m) for m in normalization["mean"]), tuple(float(s) for s in normalization["std"]))

    def embed(self, x: np.ndarray, batch_size: int = EMBED_BATCH) -> np.ndarray:
        """Features float32 [N, d] of normalized samples `x` [N, *input_shape], `batch_size` at a time:
        only one batch is converted to float32 at a time, and each batch's features are written
        into the one output array, so memory beyond `x` and the features stays one batch's."""
        x = np.asarray(x)
        expected = self.input_shape
        if (expected is not None and x.shape[1:] != expected) or x.ndim < 2:
            described = list(expected) if expected is not None else ["..."]
            raise ValueError(f"samples of shape [N, *{described}] expected, got {list(x.shape)}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if x.shape[0] == 0:
            return np.zeros((0, int(self.metadata.get("feature_dim", 0))), dtype=np.float32)
        features: np.ndarray | None = None
        for start in range(0, x.shape[0], batch_size):
            batch = np.ascontiguousarray(x[start:start + batch_size], dtype=np.float32)
            out = self.session.run([OUTPUT_NAME], {INPUT_NAME: batch})[0]
            if features is None:
                features = np.empty((x.shape[0], *out.shape[1:]), dtype=np.float32)
            features[start:start + len(out)] = out
        assert features is not None  # x holds at least one sample: the loop ran
        return features
