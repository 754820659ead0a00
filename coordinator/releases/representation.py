"""The run's global body, rebuilt from the coordinator's state arrays and ready for `export`.

The coordinator's global state (in memory during a run, or read back from its checkpoint by
`edgepfl export`) holds the body as `body.*` arrays. RepPer's global state holds the BatchNorm
running statistics too; algorithms that share the body but keep those statistics personal
(FedAvg, FedPer, FedRep, ...) get them from the devices in the release phase, pooled for the
global body (`body_statistics_needed` says which; `save_body_statistics` keeps them beside the
checkpoint for a later `edgepfl export`). A body without its statistics would normalize with
the initial ones and give meaningless features, so that is an error, not a warning; so is a
body that is personal (LG-FedAvg), which has nothing global to export.

`build_run_body` is the one place that turns a run's configuration into a fresh module and the
description of its task; `run_samples` the one place that finds real samples of the run's data.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from edge_sdk.data import Dataset, TaskSpec, load_dataset, load_user_dataset, resolve_task
from edge_sdk.models import ModelSpec, build_body, default_model_for, model_name, statistics_keys
from edge_sdk.protocol import ArrayGroup
from edge_sdk.store import write_atomic

from ..run.folder import RunFolder

log = logging.getLogger(__name__)

PARTS = ("body",)
_PREFIX = "body."
_MAX_LISTED = 8


class RepresentationError(ValueError):
    """A run whose global state does not hold a complete, exportable representation."""


@dataclass(frozen=True)
class Representation:
    """A body of the run's model, the shape of one sample, and the metadata to embed with it
    (task, normalization, classes, model; once loaded, also algorithm, run id and round)."""

    body: nn.Module
    input_shape: tuple[int, ...]
    metadata: dict[str, Any]


def run_task(config: Mapping[str, Any]) -> TaskSpec:
    """The run's task: as the configuration records it (`task`), else resolved from its dataset,
    data file and declared `[task]` table."""
    if "task" in config:
        return TaskSpec.from_plain(config["task"])
    try:
        return resolve_task(config.get("dataset"), config.get("data"), config.get("data_dir"),
                            config.get("declared_task"))
    except ValueError as exc:
        raise RepresentationError(f"the run's task is unknown: {exc}") from None


def build_run_body(config: Mapping[str, Any], model: ModelSpec | None = None) -> Representation:
    """A fresh body of the run's model (`model`, else the configuration's `model`) for the run's
    task (the run's configuration as its checkpoint records it)."""
    task = run_task(config)
    spec = model if model is not None else config.get("model", "auto")
    spec = default_model_for(task) if spec == "auto" else spec
    body, _ = build_body(spec, task)
    metadata = {"task": task.to_plain(), "normalization": {"mean": list(task.mean), "std": list(task.std)},
                "class_names": list(task.class_names), "dataset": task.name, "model": model_name(spec)}
    return Representation(body, task.input_shape, metadata)


def _run_pool(config: Mapping[str, Any], data_dir: str | None) -> Dataset:
    """The normalized pool of the run's data: its built-in dataset or its data file."""
    if config.get("dataset"):
        return load_dataset(config["dataset"], data_dir if data_dir is not None else config.get("data_dir"))
    label_column = (config.get("declared_task") or {}).get("label_column")
    return load_user_dataset(config["data"], run_task(config), label_column=label_column)


def run_samples(config: Mapping[str, Any], data_dir: str | None, count: int,
                held_out: int = 0) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """`count` real normalized samples of the run's data (an order seeded by the run's seed) for
    parity checks and calibration, and up to `held_out` other labelled ones; `data_dir`
    defaults to the run's."""
    pool = _run_pool(config, data_dir)
    order = np.random.default_rng(int(config.get("seed", 0))).permutation(len(pool.y))
    rest = order[count:count + held_out]
    return pool.x[order[:count]], (pool.x[rest], pool.y[rest])


def _listed(keys: set[str]) -> str:
    """The body's `keys` as the state names them (`body.*`), at most _MAX_LISTED of them."""
    ordered = sorted(f"{_PREFIX}{key}" for key in keys)
    more = f" and {len(ordered) - _MAX_LISTED} more" if len(ordered) > _MAX_LISTED else ""
    return ", ".join(ordered[:_MAX_LISTED]) + more


def _stripped(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {key[len(_PREFIX):]: value for key, value in arrays.items() if key.startswith(_PREFIX)}


def _body_arrays(state: Mapping[str, ArrayGroup]) -> dict[str, np.ndarray]:
    """The `body.*` arrays of every global state group, with the prefix stripped."""
    arrays: dict[str, np.ndarray] = {}
    for values in state.values():
        for name, value in _stripped(values).items():
            if name in arrays and not np.array_equal(arrays[name], value):
                raise RepresentationError(f"{_PREFIX}{name} appears in several global state groups with "
                                          "different values")
            arrays[name] = value
    return arrays


def _missing_statistics(body: nn.Module, arrays: Mapping[str, np.ndarray], config: Mapping[str, Any], run_id: str,
                        *, allowed: bool) -> set[str]:
    """The body's BatchNorm statistics missing from `arrays`, an error unless `allowed`; a
    missing parameter is always an error: that body is personal."""
    missing = set(body.state_dict()) - set(arrays)
    statistics = missing & statistics_keys(body)
    lacks = f"the global state of {config.get('algorithm', '?')} run {run_id} lacks the body's"
    if missing - statistics:
        raise RepresentationError(f"{lacks} parameters ({_listed(missing - statistics)}): its body is personal, "
                                  "so there is nothing global to export")
    if statistics and not allowed:
        raise RepresentationError(f"{lacks} BatchNorm running statistics ({_listed(statistics)}): release the run "
                                  f"(`--release`) so the devices pool them into the run folder's body statistics")
    return statistics


def body_statistics_needed(state: Mapping[str, ArrayGroup], config: Mapping[str, Any], *,
                           run_id: str, model: ModelSpec | None = None) -> dict[str, tuple[int, ...]]:
    """The body's BatchNorm statistics (`body.*` keys and shapes) that a release needs from the
    devices: empty when the global state holds them (RepPer). Raises RepresentationError when
    the body is not global at all."""
    body = build_run_body(config, model).body
    missing = _missing_statistics(body, _body_arrays(state), config, run_id, allowed=True)
    shapes = body.state_dict()
    return {f"{_PREFIX}{key}": tuple(shapes[key].shape) for key in sorted(missing)}


def representation(state: Mapping[str, ArrayGroup], config: Mapping[str, Any], *, run_id: str, round_: int,
                   statistics: Mapping[str, np.ndarray] | None = None, part: str = "body",
                   model: ModelSpec | None = None) -> Representation:
    """The run's global `part` (only "body" for now) built from the global `state` arrays and
    the pooled `statistics` (`body.*` keys), weights loaded, in eval mode."""
    if part not in PARTS:
        raise ValueError(f"cannot export part {part!r}; exportable parts: {', '.join(PARTS)}")
    run = build_run_body(config, model)
    arrays = {**_stripped(statistics or {}), **_body_arrays(state)}
    _missing_statistics(run.body, arrays, config, run_id, allowed=False)
    expected = set(run.body.state_dict())
    unexpected = set(arrays) - expected
    model = run.metadata.get("model", "the run's model")
    if unexpected:
        raise RepresentationError(f"the global state's body has arrays {model} does not: {_listed(unexpected)}")
    try:
        run.body.load_state_dict({key: torch.from_numpy(np.array(arrays[key])) for key in expected})
    except RuntimeError as exc:
        raise RepresentationError(f"the global state's body does not fit {model}: {exc}") from None
    run.body.eval()
    metadata = {**run.metadata, "input_shape": list(run.input_shape), "algorithm": config.get("algorithm"),
                "run_id": run_id, "round": round_}
    return Representation(run.body, run.input_shape, metadata)


def save_body_statistics(folder: RunFolder, round_: int, arrays: Mapping[str, np.ndarray]) -> Path:
    """Write pooled body statistics (`body.*` keys) for the state of `round_` atomically."""
    buffer = io.BytesIO()
    np.savez(buffer, round=np.int64(round_), **arrays)  # type: ignore[arg-type]  # keys are body.*, no option
    path = folder.body_statistics
    write_atomic(path, buffer.getvalue())
    return path


def saved_body_statistics(folder: RunFolder, round_: int) -> dict[str, np.ndarray]:
    """The pooled body statistics (`body.*` keys) saved for the state of `round_`, or nothing:
    statistics of an earlier round's body do not fit this one."""
    path = folder.body_statistics
    if not path.exists():
        return {}
    with np.load(path, allow_pickle=False) as saved:
        if "round" not in saved.files or int(saved["round"]) != round_:
            log.warning("%s is not for round %d: ignored", path, round_)
            return {}
        return {key: saved[key] for key in saved.files if key.startswith(_PREFIX)}
