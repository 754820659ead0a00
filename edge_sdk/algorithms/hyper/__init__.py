"""Each algorithm's hyperparameters, in modules that import neither torch nor the algorithm.

A module here is named after its algorithm id and defines `Hyper`, the dataclass its device
and server classes use; an algorithm without a module has none (`NoHyper`). Checking `--set`
and `[algorithm.<id>]` values therefore takes no heavy import (`hyper_class`).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


@dataclass(frozen=True)
class NoHyper:
    """For algorithms without hyperparameters of their own."""


def hyper_class(algorithm_id: str) -> type[DataclassInstance]:
    """The Hyper dataclass of `algorithm_id` (a known id), without importing its algorithm."""
    module_name = f"{__name__}.{algorithm_id}"
    if importlib.util.find_spec(module_name) is None:
        return NoHyper
    return importlib.import_module(module_name).Hyper
