"""Registry of device-side algorithms: one module per algorithm id, imported on demand.

An algorithm is its module and nothing else: the ids are the names of this package's modules
(`pkgutil`, which reads the folder and imports nothing), minus the infrastructure modules in
`INFRASTRUCTURE`; each algorithm module exposes its class as `DEVICE`, whose `id` is the
module's name. Importing this package and listing `ALGORITHM_IDS` therefore imports no
algorithm and no torch, which weak devices and the CLI's argument checks rely on.

What tables and plots say about an algorithm (its `display_name`, `citation`, `table_rank` and
whether it is a `paper_method`) is declared once, as class variables of its device class, and
read by `in_table_order`, which imports every algorithm (and torch): the benchmarks and docs
import torch anyway, and a light module per algorithm for four constants would be a second
place to edit. `ALGORITHM_IDS` is alphabetical; `in_table_order` is the order of the tables and
of the plots' colours. The coordinator's registry holds the same ids.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import DeviceAlgorithm

INFRASTRUCTURE = frozenset({"base", "torch_device", "part_sharing", "hyper"})
"""The modules of this package that are not algorithms: the interfaces, the shared plumbing
and the light hyperparameter declarations."""

ALGORITHM_IDS: tuple[str, ...] = tuple(sorted(
    module.name for module in pkgutil.iter_modules(__path__) if module.name not in INFRASTRUCTURE))
"""Every algorithm id, alphabetical: the names of this package's algorithm modules."""


def load(algorithm_id: str) -> type[DeviceAlgorithm]:
    """The device algorithm class for `algorithm_id`."""
    if algorithm_id not in ALGORITHM_IDS:
        raise ValueError(f"unknown algorithm {algorithm_id!r}; known: {', '.join(ALGORITHM_IDS)}")
    return importlib.import_module(f"{__name__}.{algorithm_id}").DEVICE


def in_table_order() -> tuple[type[DeviceAlgorithm], ...]:
    """Every device class by its `table_rank`: the order of the benchmarks' tables and of the
    plots' colours. Imports every algorithm, and so torch."""
    return tuple(sorted((load(algorithm_id) for algorithm_id in ALGORITHM_IDS), key=lambda cls: cls.table_rank))
