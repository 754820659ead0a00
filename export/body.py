"""Export a body held in memory to the ONNX files a release or `edgepfl export` ships.

`export_body` takes an `nn.Module` with its weights loaded, the shape of one sample ([C, H, W],
[C, L] or [D]) and the metadata to embed. It never reads a checkpoint and never builds a model
from a name: the coordinator passes the body of the state it holds, and the `edgepfl export`
command the body it rebuilt from a checkpoint. The file at `out_path` is the precision asked
for: fp32 (default), fp16, or int8; int8 is quantized from an fp32 export that is kept as
`<stem>.fp32.onnx` with `also_fp32` and otherwise lives only in a temporary folder.

Parity with PyTorch is checked on seeded random samples and on the caller's real samples when
given; those also calibrate int8 (seeded random ones stand in without them). The int8 model's
agreement with fp32 is measured on held-out labelled samples when given (feature correlation,
max |int8 - fp32|, and a logistic-regression probe, the weak devices' `lr` head, fitted on fp32
features and scored with both), else on other seeded random samples (no probe). The summary
names every file written and which operators int8 left in float.
"""

from __future__ import annotations

import copy
import logging
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .onnx_export import ExportResult, cpu_session, export_module, random_samples, run_batched, sample_shape
from .quantize import QuantizeResult, quantize_int8

log = logging.getLogger(__name__)

AGREEMENT_SEED_OFFSET = 1
"""The seeded random samples of the int8 agreement use seed + this (not the calibration's)."""


def fp32_path(out_path: str | Path) -> Path:
    """Where `also_fp32` keeps the fp32 model beside the int8 one at `out_path`: `<stem>.fp32.onnx`."""
    out_path = Path(out_path)
    return out_path.with_name(f"{out_path.stem}.fp32.onnx")


def feature_dim(body: nn.Module, input_shape: Sequence[int]) -> int:
    """The width d of the features [N, d] the body computes; a ValueError when its output is
    not a batch of vectors."""
    shape = sample_shape(input_shape)
    module = copy.deepcopy(body).cpu().eval()
    with torch.no_grad():
        output = module(torch.from_numpy(random_samples(shape, 2, seed=0)))
    if output.ndim != 2 or output.shape[0] != 2:
        raise ValueError(f"a body must map [N, {', '.join(map(str, shape))}] to features [N, d]; this one gives "
                         f"{list(output.shape)} for N = 2 (flatten or pool its output)")
    return int(output.shape[1])


def _file(written: ExportResult | QuantizeResult, precision: str) -> dict[str, Any]:
    return {"path": str(written.path), "precision": precision, "size_bytes": written.size_bytes,
            "sha256": written.sha256}


def _probe(fp32: np.ndarray, int8: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """A logistic-regression probe fitted on the first half of the fp32 features, scored on the
    other half with fp32 and with int8 features, and how often the two predictions agree."""
    from edge_sdk.lite.heads import fit_head

    n = len(labels) // 2
    probe = fit_head("lr", fp32[:n], labels[:n], num_classes=int(labels.max()) + 1)
    with_fp32, with_int8 = probe.predict(fp32[n:]), probe.predict(int8[n:])
    accuracy_fp32, accuracy_int8 = float(np.mean(with_fp32 == labels[n:])), float(np.mean(with_int8 == labels[n:]))
    return {"probe_accuracy_fp32": accuracy_fp32, "probe_accuracy_int8": accuracy_int8,
            "accuracy_change_points": 100.0 * (accuracy_int8 - accuracy_fp32),
            "probe_prediction_agreement": float(np.mean(with_fp32 == with_int8))}


def _agreement(fp32: ExportResult, int8: QuantizeResult, held_out: tuple[np.ndarray, np.ndarray] | None,
               input_shape: tuple[int, ...], count: int, seed: int) -> dict[str, Any]:
    """How closely the int8 model's features follow the fp32 model's (see the module docstring)."""
    if held_out is not None and len(held_out[0]) == 0:
        held_out = None
    x = held_out[0] if held_out is not None else random_samples(input_shape, count, seed + AGREEMENT_SEED_OFFSET)
    reference = run_batched(cpu_session(fp32.path.read_bytes()), x)
    quantized = run_batched(cpu_session(int8.path.read_bytes()), x)
    agreement: dict[str, Any] = {
        "agreement_inputs": f"{len(x)} {'held-out real' if held_out is not None else 'seeded random'} samples",
        "feature_correlation": float(np.corrcoef(reference.ravel(), quantized.ravel())[0, 1]),
        "feature_max_abs_diff": float(np.max(np.abs(reference - quantized))),
    }
    if held_out is not None and len(held_out[1]) >= 2:
        agreement.update(_probe(reference, quantized, np.asarray(held_out[1])))
    return agreement


def check_options(quantize: str | None, also_fp32: bool, fp16: bool, calibration_size: int) -> None:
    """A ValueError naming the option when `export_body`'s options contradict each other."""
    if quantize not in (None, "int8"):
        raise ValueError(f"quantize must be None or 'int8', got {quantize!r}")
    if quantize and fp16:
        raise ValueError("int8 quantization starts from the fp32 model; fp16 and int8 exclude each other")
    if also_fp32 and not quantize:
        raise ValueError("also_fp32 (--also-fp32) keeps the fp32 model beside an int8 one; it needs "
                         "quantize='int8' (--quantize int8)")
    if calibration_size < 1:
        raise ValueError(f"calibration_size must be positive, got {calibration_size}")


def export_body(
    body: nn.Module,
    input_shape: Sequence[int],
    out_path: str | Path,
    *,
    metadata: Mapping[str, Any],
    quantize: str | None = None,
    also_fp32: bool = False,
    fp16: bool = False,
    samples: np.ndarray | None = None,
    held_out: tuple[np.ndarray, np.ndarray] | None = None,
    calibration_size: int = 256,
    seed: int = 0,
) -> dict[str, Any]:
    """Write `body` at `out_path` in the precision asked for and return a JSON-safe summary.

    `samples` [N, *input_shape] are real normalized samples for the parity check and the int8
    calibration (None: `calibration_size` seeded random ones calibrate); `held_out` (x, labels)
    are other real samples the int8 agreement is measured on. The metadata embedded is
    `metadata` plus `input_shape` and `feature_dim` (and, for int8, `quantization`). The summary
    holds `path`, `precision`, `size_bytes`, `sha256` and `metadata` of the file at `out_path`,
    `files` (every file written, with its precision and size), `max_abs_diff` (max |ONNX -
    PyTorch| of the fp32, or fp16, export over every input set checked), `parity` (per input
    set), and `int8` (None, or the size ratio, the agreement and the operators quantized and
    left in float).
    """
    check_options(quantize, also_fp32, fp16, calibration_size)
    shape = sample_shape(input_shape)
    out_path = Path(out_path)
    embedded = {**metadata, "input_shape": list(shape), "feature_dim": feature_dim(body, shape)}
    if quantize is None:
        exported = export_module(body, shape, out_path, metadata=embedded, fp16=fp16, check_inputs=samples, seed=seed)
        return _summary(exported, [_file(exported, "fp16" if fp16 else "fp32")], exported.metadata, int8=None)
    calibration = samples if samples is not None else random_samples(shape, calibration_size, seed)
    with tempfile.TemporaryDirectory(prefix="edgepfl-export-") as tmp:
        exported = export_module(body, shape, fp32_path(out_path) if also_fp32 else Path(tmp) / "fp32.onnx",
                                 metadata=embedded, check_inputs=samples, seed=seed)
        quantized = quantize_int8(exported.path, out_path, calibration)
        int8 = {
            "ratio_to_fp32": quantized.ratio_to_fp32,
            "calibration_inputs": f"{len(calibration)} {'real' if samples is not None else 'seeded random'} samples",
            **_agreement(exported, quantized, held_out, shape, calibration_size, seed),
            "quantized_operators": quantized.operators.quantized,
            "left_in_float": quantized.operators.left_in_float,
            "left_in_float_text": quantized.operators.describe(),
        }
    files = [_file(quantized, "int8"), *([_file(exported, "fp32")] if also_fp32 else [])]
    log.info("int8 at %s: %.2fx the fp32 size, features correlate %.4f; %s", out_path, quantized.ratio_to_fp32,
             int8["feature_correlation"], int8["left_in_float_text"])
    return _summary(exported, files, quantized.metadata, int8=int8)


def _summary(exported: ExportResult, files: list[dict[str, Any]], metadata: dict[str, Any], *,
             int8: dict[str, Any] | None) -> dict[str, Any]:
    """The summary of `export_body`: the file at the output path is `files[0]`; `exported` is
    the float export whose parity was checked."""
    return {
        **files[0],
        "metadata": metadata,
        "input_shape": metadata["input_shape"],
        "files": files,
        "max_abs_diff": exported.max_abs_diff,
        "parity": exported.parity,
        "int8": int8,
    }
