"""A trained run's representation, loaded from its checkpoint and exported for weak devices.

`load_representation` rebuilds the run's body from the coordinator's latest checkpoint: the
`body.*` arrays of the global state, BatchNorm running statistics included. RepPer's global
state holds them; algorithms that share the body but keep BatchNorm statistics personal
(FedAvg, FedPer, FedRep, ...) get them from `body_statistics.npz` in the run folder, which the
coordinator's release phase writes after pooling the statistics devices computed for the
global body (`body_statistics_needed` says which). A body without its statistics would normalize
with the initial ones and give meaningless features, so that is an error, not a warning; so is a
body that is personal (LG-FedAvg), which has nothing global to export.

`export_run` writes the ONNX representation (parity-checked on real images of the run's
dataset), optionally an int8 twin `<stem>.int8.onnx` next to it, and reports sizes, hashes,
the parity and, for int8, what quantization costs a logistic-regression probe in accuracy.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from coordinator import checkpoint
from edge_sdk.data import DATASETS, DatasetMeta, load_dataset
from edge_sdk.models import build_body, default_model_for, statistics_keys
from edge_sdk.store import write_atomic

from .onnx_export import FORMAT, cpu_session, export_module, run_batched
from .quantize import quantize_int8

log = logging.getLogger(__name__)

PARTS = ("body",)
CHECKPOINT_NAME = "checkpoint.msgpack"
STATISTICS_NAME = "body_statistics.npz"
"""Pooled BatchNorm statistics of the global body, for runs whose global state lacks them."""
PROBE_TRAIN = 1000
PROBE_TEST = 1000
"""Examples of the run's pool the int8 accuracy probe is fitted on / scored on."""
_MAX_LISTED = 8


class RepresentationError(ValueError):
    """A run whose checkpoint does not hold a complete, exportable representation."""


@dataclass
class Representation:
    body: nn.Module
    meta: DatasetMeta
    metadata: dict[str, Any]
    config: dict[str, Any]


def _listed(keys: set[str]) -> str:
    """The body's `keys` as the checkpoint names them (`body.*`), at most _MAX_LISTED of them."""
    ordered = sorted(f"body.{key}" for key in keys)
    more = f" and {len(ordered) - _MAX_LISTED} more" if len(ordered) > _MAX_LISTED else ""
    return ", ".join(ordered[:_MAX_LISTED]) + more


def _body_arrays(state: dict[str, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The `body.*` arrays of every global state group, with the prefix stripped."""
    arrays: dict[str, np.ndarray] = {}
    for values in state.values():
        for key, value in values.items():
            if not key.startswith("body."):
                continue
            name = key[len("body."):]
            if name in arrays and not np.array_equal(arrays[name], value):
                raise RepresentationError(f"{key} appears in several global state groups with different values")
            arrays[name] = value
    return arrays


def save_body_statistics(run_dir: str | Path, round_: int, arrays: dict[str, np.ndarray]) -> Path:
    """Write pooled body statistics (`body.*` keys) for the checkpoint of `round_` atomically."""
    buffer = io.BytesIO()
    np.savez(buffer, round=np.int64(round_), **arrays)
    path = Path(run_dir) / STATISTICS_NAME
    write_atomic(path, buffer.getvalue())
    return path


def _saved_statistics(run_dir: Path, round_: int) -> dict[str, np.ndarray]:
    """The pooled body statistics saved for the checkpoint of `round_` (prefix stripped), or
    nothing: statistics of an earlier round's body do not fit this one."""
    path = run_dir / STATISTICS_NAME
    if not path.exists():
        return {}
    with np.load(path, allow_pickle=False) as saved:
        if "round" not in saved.files or int(saved["round"]) != round_:
            log.warning("%s is not for round %d: ignored", path, round_)
            return {}
        return {key[len("body."):]: saved[key] for key in saved.files if key.startswith("body.")}


def _checkpoint_body(run_dir: Path) -> tuple[checkpoint.Checkpoint, dict[str, Any], DatasetMeta, str, nn.Module, int]:
    """The run's latest checkpoint, its config, dataset, model name and a freshly built body."""
    saved = checkpoint.load(run_dir / CHECKPOINT_NAME)
    if saved is None:
        raise RepresentationError(f"{run_dir} has no {CHECKPOINT_NAME}: no round of this run completed")
    config = dict(saved.history.get("config") or {})
    if "dataset" not in config or "algorithm" not in config:
        raise RepresentationError(f"{run_dir / CHECKPOINT_NAME} does not record the run's configuration")
    meta = DATASETS[config["dataset"]]
    model = config.get("model", "auto")
    model = default_model_for(meta.image_size) if model == "auto" else model
    body, feature_dim = build_body(model, in_channels=meta.channels, image_size=meta.image_size)
    return saved, config, meta, model, body, feature_dim


def _missing_statistics(body: nn.Module, arrays: dict[str, np.ndarray], algorithm: str, run_id: str, *,
                        allowed: bool) -> set[str]:
    """The body's BatchNorm statistics missing from `arrays`, an error unless `allowed`; a
    missing parameter is always an error: that body is personal."""
    missing = set(body.state_dict()) - set(arrays)
    statistics = missing & statistics_keys(body)
    lacks = f"the global state of {algorithm} run {run_id} lacks the body's"
    if missing - statistics:
        raise RepresentationError(f"{lacks} parameters ({_listed(missing - statistics)}): its body is personal, "
                                  "so there is nothing global to export")
    if statistics and not allowed:
        raise RepresentationError(f"{lacks} BatchNorm running statistics ({_listed(statistics)}): release the run "
                                  f"(`--release`) so the devices pool them into {STATISTICS_NAME}")
    return statistics


def body_statistics_needed(run_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """The body's BatchNorm statistics (`body.*` keys and shapes) that a release of this run
    needs from the devices: empty when the global state holds them (RepPer). Raises
    RepresentationError when the body is not global at all."""
    saved, config, _, _, body, _ = _checkpoint_body(Path(run_dir))
    missing = _missing_statistics(body, _body_arrays(saved.state), config["algorithm"], saved.run_id, allowed=True)
    state = body.state_dict()
    return {f"body.{key}": tuple(state[key].shape) for key in sorted(missing)}


def load_representation(run_dir: str | Path, part: str = "body") -> Representation:
    """The run's global `part` (only "body" for now) with its weights loaded, in eval mode."""
    if part not in PARTS:
        raise ValueError(f"cannot export part {part!r}; exportable parts: {', '.join(PARTS)}")
    run_dir = Path(run_dir)
    saved, config, meta, model, body, feature_dim = _checkpoint_body(run_dir)
    algorithm = config["algorithm"]
    arrays = {**_saved_statistics(run_dir, saved.round), **_body_arrays(saved.state)}
    _missing_statistics(body, arrays, algorithm, saved.run_id, allowed=False)
    expected = set(body.state_dict())
    unexpected = set(arrays) - expected
    if unexpected:
        raise RepresentationError(f"the checkpoint's body has arrays {model} does not: {_listed(unexpected)}")
    try:
        body.load_state_dict({key: torch.from_numpy(np.array(arrays[key])) for key in expected})
    except RuntimeError as exc:
        raise RepresentationError(f"the checkpoint's body does not fit {model}: {exc}") from None
    body.eval()
    metadata = {
        "format": FORMAT,
        "input_shape": [meta.channels, meta.image_size, meta.image_size],
        "normalization": {"mean": list(meta.mean), "std": list(meta.std)},
        "feature_dim": feature_dim,
        "class_names": list(meta.class_names),
        "algorithm": algorithm,
        "run_id": saved.run_id,
        "round": saved.round,
        "dataset": meta.name,
        "model": model,
    }
    return Representation(body, meta, metadata, config)


def int8_path(out_path: str | Path) -> Path:
    """Where `export_run` writes the int8 model for `out_path`: `<stem>.int8.onnx` beside it."""
    out_path = Path(out_path)
    return out_path.with_name(f"{out_path.stem}.int8.onnx")


def _probe_accuracies(fp32: np.ndarray, int8: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """A logistic-regression probe (the weak devices' `lr` head) fitted on the first PROBE_TRAIN
    fp32 features, scored on the rest with fp32 and with int8 features."""
    from edge_sdk.lite.heads import fit_head

    n = min(PROBE_TRAIN, len(labels) // 2)
    probe = fit_head("lr", fp32[:n], labels[:n], num_classes=int(labels.max()) + 1)
    return float(np.mean(probe.predict(fp32[n:]) == labels[n:])), float(np.mean(probe.predict(int8[n:]) == labels[n:]))


def export_run(
    run_dir: str | Path,
    out_path: str | Path,
    *,
    part: str = "body",
    quantize: str | None = None,
    fp16: bool = False,
    calibration_size: int = 256,
    data_dir: str | None = None,
) -> dict[str, Any]:
    """Export the run's representation to `out_path` (fp32, or fp16 with `fp16`).

    Parity is checked on `calibration_size` images of the run's dataset (seeded by the run's
    seed; `data_dir` defaults to the run's). `quantize="int8"` also writes the int8 model to
    `int8_path(out_path)`, calibrated on those images, and measures a logistic-regression probe
    fitted on fp32 features of up to PROBE_TRAIN other pool images, scored with fp32 and with
    int8 features on up to PROBE_TEST more. Returns a summary (JSON-serializable).
    """
    if quantize not in (None, "int8"):
        raise ValueError(f"quantize must be None or 'int8', got {quantize!r}")
    if quantize and fp16:
        raise ValueError("int8 quantization starts from the fp32 model; fp16 and int8 exclude each other")
    if calibration_size < 1:
        raise ValueError(f"calibration_size must be positive, got {calibration_size}")
    representation = load_representation(run_dir, part)
    config = representation.config
    pool = load_dataset(config["dataset"], data_dir if data_dir is not None else config.get("data_dir"))
    order = np.random.default_rng(int(config.get("seed", 0))).permutation(len(pool.y))
    sample = pool.x[order[:calibration_size]]
    meta = representation.meta
    exported = export_module(representation.body, (meta.channels, meta.image_size, meta.image_size), out_path,
                             metadata={**representation.metadata, "class_names": list(pool.meta.class_names)},
                             fp16=fp16, check_inputs=sample)
    summary: dict[str, Any] = {
        "run_dir": str(run_dir),
        "part": part,
        "precision": "fp16" if fp16 else "fp32",
        "path": str(exported.path),
        "size_bytes": exported.size_bytes,
        "sha256": exported.sha256,
        "max_abs_diff": exported.max_abs_diff,
        "metadata": exported.metadata,
        "int8": None,
    }
    if quantize == "int8":
        quantized = quantize_int8(exported.path, int8_path(out_path), sample)
        probe = order[calibration_size:calibration_size + PROBE_TRAIN + PROBE_TEST]
        fp32_features = run_batched(cpu_session(exported.path.read_bytes()), pool.x[probe])
        int8_features = run_batched(cpu_session(quantized.path.read_bytes()), pool.x[probe])
        accuracy_fp32, accuracy_int8 = _probe_accuracies(fp32_features, int8_features, pool.y[probe])
        summary["int8"] = {
            "path": str(quantized.path),
            "size_bytes": quantized.size_bytes,
            "ratio_to_fp32": quantized.ratio_to_fp32,
            "feature_correlation": float(np.corrcoef(fp32_features.ravel(), int8_features.ravel())[0, 1]),
            "feature_max_abs_diff": float(np.max(np.abs(fp32_features - int8_features))),
            "probe_accuracy_fp32": accuracy_fp32,
            "probe_accuracy_int8": accuracy_int8,
            "accuracy_change_points": 100.0 * (accuracy_int8 - accuracy_fp32),
        }
        log.info("int8: %.2fx the fp32 size, probe accuracy %.4f -> %.4f", quantized.ratio_to_fp32,
                 accuracy_fp32, accuracy_int8)
    return summary
