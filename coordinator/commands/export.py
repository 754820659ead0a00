"""`edgepfl export --run DIR`: the one place that reads a run's checkpoint to export its body.

The run's latest checkpoint gives the global state and the configuration; the body is rebuilt
and loaded by `coordinator.releases.representation` (with the BatchNorm statistics the release pooled
into `body_statistics.npz`, for algorithms that keep them personal) and written by
`export.export_body`, parity-checked on real samples of the run's data. With int8 the agreement
with fp32 is measured on other samples of the run's pool (a logistic-regression probe).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from export import check_options, export_body

from ..releases.representation import (
    Representation,
    RepresentationError,
    representation,
    run_samples,
    saved_body_statistics,
)
from ..run import checkpoint
from ..run.folder import RunFolder

PROBE_SAMPLES = 2000
"""Held-out samples of the run's pool the int8 probe is fitted on (half) and scored on (half)."""


def _read(run_dir: Path, part: str) -> tuple[Representation, dict[str, Any]]:
    """The run's global `part` as its latest checkpoint holds it, and the run's configuration."""
    folder = RunFolder(run_dir)
    saved = checkpoint.load(folder.checkpoint)
    if saved is None:
        raise RepresentationError(f"{run_dir} has no {folder.checkpoint.name}: no round of this run completed")
    config = dict(saved.history.get("config") or {})
    if "algorithm" not in config:
        raise RepresentationError(f"{folder.checkpoint} does not record the run's configuration")
    loaded = representation(saved.state, config, run_id=saved.run_id, round_=saved.round,
                            statistics=saved_body_statistics(folder, saved.round), part=part)
    return loaded, config


def load_representation(run_dir: str | Path, part: str = "body") -> Representation:
    """The global `part` of the run in `run_dir` as its latest checkpoint holds it."""
    return _read(Path(run_dir), part)[0]


def export_run(
    run_dir: str | Path,
    out_path: str | Path,
    *,
    part: str = "body",
    quantize: str | None = None,
    also_fp32: bool = False,
    fp16: bool = False,
    calibration_size: int = 256,
    data_dir: str | None = None,
) -> dict[str, Any]:
    """Export the run's representation to `out_path` in the precision asked for (fp32, fp16
    with `fp16`, int8 with `quantize="int8"`, keeping `<stem>.fp32.onnx` too with `also_fp32`).

    `calibration_size` samples of the run's data (seeded by the run's seed; `data_dir` defaults
    to the run's) check parity and calibrate int8. Returns `export.export_body`'s summary plus
    `run_dir` and `part` (JSON-serializable).
    """
    check_options(quantize, also_fp32, fp16, calibration_size)
    loaded, config = _read(Path(run_dir), part)
    samples, held_out = run_samples(config, data_dir, calibration_size, PROBE_SAMPLES if quantize else 0)
    summary = export_body(loaded.body, loaded.input_shape, out_path, metadata=loaded.metadata, quantize=quantize,
                          also_fp32=also_fp32, fp16=fp16, samples=samples, held_out=held_out if quantize else None,
                          calibration_size=calibration_size, seed=int(config.get("seed", 0)))
    return {"run_dir": str(run_dir), "part": part, **summary}
