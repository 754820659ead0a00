"""Feature extraction with ONNX Runtime: a released representation turns images into features.

A representation (see `export/`) is an ONNX model with one input `input` (float32 [N, C, H, W],
images normalized as `edge_sdk.data` produces them) and one output `features` (float32 [N, d]);
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

log = logging.getLogger(__name__)

INPUT_NAME = "input"
OUTPUT_NAME = "features"
PREFERRED_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
"""The order "auto" tries, keeping those this onnxruntime build offers."""


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
    """An ONNX Runtime session over a representation: `embed(images) -> features`."""

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
        log.info("representation loaded (providers %s, feature_dim %s)", self.providers, self.metadata.get("feature_dim"))

    @property
    def input_shape(self) -> tuple[int, ...] | None:
        """[C, H, W] from the metadata, when present."""
        shape = self.metadata.get("input_shape")
        return tuple(int(s) for s in shape) if shape is not None else None

    def embed(self, x: np.ndarray, batch_size: int = 256) -> np.ndarray:
        """Features float32 [N, d] of normalized images `x` [N, C, H, W], `batch_size` at a time."""
        x = np.asarray(x, dtype=np.float32)
        expected = self.input_shape
        if x.ndim != 4 or (expected is not None and x.shape[1:] != expected):
            raise ValueError(f"images of shape [N, *{list(expected or ['C', 'H', 'W'])}] expected, got {list(x.shape)}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        batches = [
            self.session.run([OUTPUT_NAME], {INPUT_NAME: np.ascontiguousarray(x[start:start + batch_size])})[0]
            for start in range(0, x.shape[0], batch_size)
        ]
        if not batches:
            return np.zeros((0, int(self.metadata.get("feature_dim", 0))), dtype=np.float32)
        return np.concatenate(batches).astype(np.float32, copy=False)
