"""Export a PyTorch feature extractor to ONNX and prove the file computes what the module does.

A released representation is the contract between the trainers and the weak devices (no torch
there), so an export that silently differs from the trained module would be the worst kind of
bug: every personalized model built on it would be wrong. `export_module` therefore exports
in memory, runs the ONNX model with onnxruntime (CPU) on seeded random inputs at two batch sizes
(which also proves the dynamic batch axis) and on caller-given real inputs, compares with the
module in eval mode, and writes the file (atomically) only when every difference is within the
tolerance; otherwise it raises `ExportMismatchError` and writes nothing. A sample is an image
[C, H, W], a signal [C, L] or a feature vector [D]; the module is any `nn.Module` mapping a batch
of them to features [N, d].

Decisions:
- The exporter is the TorchScript-based one (`dynamo=False`): torch 2.15's default exporter
  needs `onnxscript`, which the train install does not carry; the legacy one works offline and
  folds BatchNorm into the convolutions in eval mode.
- `weights_sha256` hashes the module's `state_dict` in its order: for each entry the key, the
  shape and the raw bytes, floating tensors as little-endian float32 and the others as int64.
  It identifies the weights independently of the ONNX serialization (and of fp16 conversion).
- The default parity bound scales with the output: `RELATIVE[precision] * max(1, max |torch|)`,
  1e-4 in fp32 and 1e-2 in fp16. A float32 network's rounding differences grow with its
  activations (MobileNetV3 with real BatchNorm statistics differs by ~3e-4 at outputs of ~60,
  a relative 5e-6), so a purely absolute 1e-4 would reject correct exports of deep bodies; the
  small CNNs stay far below an absolute 1e-4 (see the tests). An explicit `tolerance` is an
  absolute bound.
- fp16 uses onnxruntime's own `convert_float_to_float16(keep_io_types=True)` (onnxconverter-
  common is not installed): inputs and outputs stay float32, so callers see no difference.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import logging
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

from edge_sdk.store import write_atomic

log = logging.getLogger(__name__)

INPUT_NAME = "input"
OUTPUT_NAME = "features"
BATCH_AXIS = "batch"
FORMAT = "edgepfl-representation/1"
RELATIVE = {False: 1e-4, True: 1e-2}
"""fp16 -> the default parity bound as a fraction of max(1, max |torch output|)."""
RANDOM_BATCHES = (1, 7)
"""Batch sizes of the seeded random inputs every export is checked on."""
CHECK_BATCH = 256


class ExportMismatchError(RuntimeError):
    """The exported ONNX model does not compute what the PyTorch module computes."""


@dataclass(frozen=True)
class ExportResult:
    """One exported file and how closely it follows the PyTorch module."""

    path: Path
    sha256: str
    size_bytes: int
    max_abs_diff: float
    metadata: dict[str, Any]
    """The metadata_props as written (decoded)."""
    parity: dict[str, float]
    """max |onnx - torch| per input set checked ("random batch of 1", ..., "check_inputs")."""


def sample_shape(input_shape: Sequence[int]) -> tuple[int, ...]:
    """`input_shape` as a tuple of 1 to 3 positive ints ([D], [C, L] or [C, H, W]), or a
    ValueError naming it."""
    try:
        shape = tuple(int(s) for s in input_shape)
    except (TypeError, ValueError):
        raise ValueError(f"input_shape must be a sequence of ints, got {input_shape!r}") from None
    if not 1 <= len(shape) <= 3 or any(s < 1 for s in shape):
        raise ValueError(f"input_shape must be [D], [C, L] or [C, H, W] with positive sizes, got {list(shape)}")
    return shape


def random_samples(input_shape: Sequence[int], count: int, seed: int) -> np.ndarray:
    """`count` seeded standard-normal samples [count, *input_shape] (float32): stand-ins for
    normalized inputs when no real ones are at hand."""
    return np.random.default_rng(seed).standard_normal((count, *sample_shape(input_shape))).astype(np.float32)


def weights_sha256(module: nn.Module) -> str:
    """The sha256 of the module's weights as float32 (see the module docstring for the layout)."""
    digest = hashlib.sha256()
    for key, tensor in module.state_dict().items():
        value = tensor.detach().cpu()
        if value.is_floating_point():
            array = np.ascontiguousarray(value.to(torch.float32).numpy(), dtype="<f4")
        else:
            array = np.ascontiguousarray(value.to(torch.int64).numpy(), dtype="<i8")
        digest.update(f"{key}\0{list(array.shape)}\0".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def torch_to_onnx(module: nn.Module, example: torch.Tensor, *, input_name: str, output_name: str,
                  opset: int) -> onnx.ModelProto:
    """Trace `module` (already in eval mode, on the CPU) on `example` into an ONNX model whose
    first axis is the dynamic axis "batch"."""
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export.*")
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.onnx")
        torch.onnx.export(
            module, (example,), buffer,  # type: ignore[arg-type]  # the TorchScript exporter writes to BytesIO
            dynamo=False, opset_version=opset, do_constant_folding=True,
            input_names=[input_name], output_names=[output_name],
            dynamic_axes={input_name: {0: BATCH_AXIS}, output_name: {0: BATCH_AXIS}},
        )
    return onnx.load_from_string(buffer.getvalue())


def set_metadata(model: onnx.ModelProto, metadata: Mapping[str, Any]) -> None:
    """Replace the model's metadata_props with `metadata`, every value JSON-encoded."""
    onnx.helper.set_model_props(model, {key: json.dumps(value) for key, value in metadata.items()})


def cpu_session(model: onnx.ModelProto | bytes) -> ort.InferenceSession:
    """An onnxruntime session on the CPU execution provider."""
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"])


def run_batched(session: ort.InferenceSession, x: np.ndarray, batch_size: int = CHECK_BATCH) -> np.ndarray:
    """Run a one-input, one-output session on `x` in batches; returns the concatenated output."""
    name = session.get_inputs()[0].name
    outputs = [session.run(None, {name: np.ascontiguousarray(x[i:i + batch_size], dtype=np.float32)})[0]
               for i in range(0, len(x), batch_size)]
    return np.concatenate(outputs)


def _reference(module: nn.Module, x: np.ndarray, batch_size: int = CHECK_BATCH) -> np.ndarray:
    with torch.no_grad():
        return np.concatenate([module(torch.from_numpy(np.array(x[i:i + batch_size]))).numpy()
                               for i in range(0, len(x), batch_size)])


def _parity(module: nn.Module, session: ort.InferenceSession, inputs: Iterable[tuple[str, np.ndarray]],
            tolerance: float | None, fp16: bool) -> dict[str, float]:
    """max |onnx - torch| per input set; raises ExportMismatchError past the bound."""
    diffs: dict[str, float] = {}
    for label, x in inputs:
        expected = _reference(module, x)
        actual = run_batched(session, x)
        if actual.shape != expected.shape:
            raise ExportMismatchError(f"{label}: ONNX output shape {list(actual.shape)}, "
                                      f"PyTorch {list(expected.shape)}")
        diff = float(np.max(np.abs(actual.astype(np.float64) - expected))) if expected.size else 0.0
        peak = float(np.max(np.abs(expected))) if expected.size else 0.0
        bound = RELATIVE[fp16] * max(1.0, peak) if tolerance is None else tolerance
        if not diff <= bound:  # also catches NaN
            raise ExportMismatchError(
                f"{label}: max |onnx - torch| = {diff:.3g} exceeds {bound:.3g} "
                f"({'fp16' if fp16 else 'fp32'}; output max |torch| = {peak:.3g})")
        log.debug("%s: max |onnx - torch| = %.3g (bound %.3g)", label, diff, bound)
        diffs[label] = diff
    return diffs


def export_module(
    module: nn.Module,
    input_shape: Sequence[int],
    path: str | Path,
    *,
    metadata: Mapping[str, Any],
    opset: int = 17,
    fp16: bool = False,
    check_inputs: np.ndarray | None = None,
    tolerance: float | None = None,
    seed: int = 0,
) -> ExportResult:
    """Export `module` ([N, *input_shape] -> [N, d]) to the ONNX file `path` and verify it.

    `input_shape` is one sample's shape: [C, H, W], [C, L] or [D]. The model has input `input`
    (float32 [batch, *input_shape]) and output `features`; its metadata_props are `metadata`
    plus `format` (unless given) and `weights_sha256`, each value JSON-encoded. The module is
    exported from an eval-mode CPU copy (the caller's module is left as it was). Parity with
    PyTorch is checked on random inputs seeded by `seed` (batches of 1 and 7) and on
    `check_inputs` [N, *input_shape]: `tolerance` bounds max |onnx - torch|; None means
    `RELATIVE[fp16] * max(1, max |torch|)` per input set (1e-4 fp32, 1e-2 fp16). A mismatch
    raises ExportMismatchError and leaves `path` untouched.
    """
    if opset < 17:
        raise ValueError(f"opset must be 17 or more, got {opset}")
    shape = sample_shape(input_shape)
    if check_inputs is not None and tuple(check_inputs.shape[1:]) != shape:
        raise ValueError(f"check_inputs have shape {list(check_inputs.shape[1:])}, the model takes {list(shape)}")
    path = Path(path)
    reference = copy.deepcopy(module).cpu().eval()
    rng = np.random.default_rng(seed)
    randoms = [(f"random batch of {n}", rng.standard_normal((n, *shape)).astype(np.float32)) for n in RANDOM_BATCHES]
    model = torch_to_onnx(reference, torch.from_numpy(randoms[-1][1]), input_name=INPUT_NAME,
                          output_name=OUTPUT_NAME, opset=opset)
    if fp16:
        from onnxruntime.transformers.float16 import convert_float_to_float16
        from onnxruntime.transformers.onnx_model import OnnxModel

        model = convert_float_to_float16(model, keep_io_types=True)
        OnnxModel.graph_topological_sort(model.graph)  # the converter appends its input casts
    written = {"format": FORMAT, **metadata, "weights_sha256": weights_sha256(reference)}
    set_metadata(model, written)
    model.producer_name = "edgepfl"
    onnx.checker.check_model(model)
    data = model.SerializeToString()
    checks = randoms if check_inputs is None else [*randoms, ("check_inputs", np.asarray(check_inputs, np.float32))]
    parity = _parity(reference, cpu_session(data), checks, tolerance, fp16)
    worst = max(parity.values())
    write_atomic(path, data)
    result = ExportResult(path, hashlib.sha256(data).hexdigest(), len(data), worst, written, parity)
    log.info("exported %s (%s, %d bytes, max |onnx - torch| %.3g)", path, "fp16" if fp16 else "fp32",
             result.size_bytes, worst)
    return result
