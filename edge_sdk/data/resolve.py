"""Which task a run or a device has: a built-in one, one inferred from a user's data, or declared.

A declaration is a TOML `[task]` table (or the same dict from Python): any of `name`, `kind`,
`input_shape`, `class_names`, `mean`, `std`, and `label_column` (the label column of a CSV). What
it declares overrides what is inferred; the rest is inferred from the data. A declaration alone
(no data, no built-in dataset) must give `kind`, `input_shape` and `class_names`; its mean and std
then default to 0 and 1 (no normalization).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from edge_sdk.data.datasets import BUILTIN_TASKS
from edge_sdk.data.task import TaskSpec
from edge_sdk.data.user_data import infer_task, read_user_data

logger = logging.getLogger(__name__)

DECLARABLE = ("name", "kind", "input_shape", "class_names", "mean", "std", "label_column")
"""The keys of a `[task]` table."""
TASK_FIELDS = ("name", "kind", "input_shape", "class_names", "mean", "std")
"""The keys of a `[task]` table that set a TaskSpec field (the others guide reading the data)."""


def check_declared(declared: dict[str, Any] | None) -> dict[str, Any]:
    """`declared` with its values in TaskSpec's types; unknown keys and bad values are named."""
    declared = dict(declared or {})
    unknown = sorted(set(declared) - set(DECLARABLE))
    if unknown:
        raise ValueError(f"[task]: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(DECLARABLE)}")
    checked: dict[str, Any] = {}
    for key, value in declared.items():
        try:
            if key in ("name", "kind", "label_column"):
                if not isinstance(value, str):
                    raise TypeError
                checked[key] = value
            elif key == "input_shape":
                checked[key] = tuple(_integer(v) for v in value)
            elif key == "class_names":
                checked[key] = tuple(str(v) for v in value)
            else:
                checked[key] = tuple(float(v) for v in value)
        except (TypeError, ValueError):
            raise ValueError(f"[task]: {key} = {value!r} is not a valid {key}") from None
    return checked


def _integer(value: Any) -> int:
    if isinstance(value, bool) or int(value) != value:
        raise ValueError(value)
    return int(value)


def resolve_task(dataset: str | None = None, data: str | None = None, data_dir: str | None = None,
                 declared: dict | None = None) -> TaskSpec:
    """The task of built-in `dataset`, or inferred from the user's `data` file, or declared.

    With a built-in `dataset` its task is taken (and `data`, if given, must fit it); otherwise the
    task is inferred from `data` (named `dataset`, or the file's stem) or built from `declared`
    alone. What `declared` says overrides either. `data_dir` is where built-in datasets live; it
    does not change their task.
    """
    declared = check_declared(declared)
    overrides = {key: declared[key] for key in TASK_FIELDS if key in declared}
    if dataset is not None and dataset in BUILTIN_TASKS:
        base = BUILTIN_TASKS[dataset]
    elif data is not None:
        hints = {key: declared.get(key) for key in ("kind", "input_shape", "class_names", "label_column")}
        user = read_user_data(data, **hints)
        base = infer_task(declared.get("name") or dataset or Path(data).stem, user)
    elif {"kind", "input_shape", "class_names"} <= set(declared):
        channels = declared["input_shape"][0] if declared["input_shape"] else 0
        base = TaskSpec(dataset or "task", declared["kind"], declared["input_shape"], len(declared["class_names"]),
                        declared["class_names"], (0.0,) * channels, (1.0,) * channels)
    elif dataset is not None:
        raise ValueError(f"unknown dataset {dataset!r}; known datasets: {', '.join(BUILTIN_TASKS)} "
                         "(or give your own data, or declare the task's kind, input_shape and class_names)")
    else:
        raise ValueError("no task: name a built-in dataset, give your own data (.npz, .csv or an ImageFolder "
                         "directory), or declare the task's kind, input_shape and class_names")
    if not overrides:
        return base
    if "class_names" in overrides:
        overrides["num_classes"] = len(overrides["class_names"])
    task = dataclasses.replace(base, **overrides)
    logger.info("task %s: %s", task.name, ", ".join(f"{k} declared" for k in sorted(overrides)))
    return task
