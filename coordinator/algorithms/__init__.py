"""Registry of coordinator-side algorithms; the same ids as `edge_sdk.algorithms` (its modules).

An algorithm with server logic of its own has a module here that exposes its class as
`SERVER`. A pure part-sharing algorithm (FedAvg and the algorithms that differ from it only on
the device) has none: its server is derived from its device class (`part_sharing.server_for`).
There is no branching on algorithm names anywhere else: the round loop only calls the
`ServerAlgorithm` interface.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import TYPE_CHECKING

from edge_sdk.algorithms import ALGORITHM_IDS
from edge_sdk.algorithms import load as load_device

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from .base import ServerAlgorithm


def hyperparameters(algorithm_id: str, values: dict) -> DataclassInstance:
    """The algorithm's Hyper dataclass from `values`, naming any unknown or bad key; imports
    neither torch nor the algorithm (`edge_sdk.algorithms.hyper`), so a run is checked first."""
    from edge_sdk.algorithms.hyper import hyper_class
    from edge_sdk.config import from_mapping

    if algorithm_id not in ALGORITHM_IDS:
        raise ValueError(f"unknown algorithm {algorithm_id!r}; known: {', '.join(ALGORITHM_IDS)}")
    return from_mapping(hyper_class(algorithm_id), values, where=f"[algorithm.{algorithm_id}]")


@functools.cache
def load(algorithm_id: str) -> type[ServerAlgorithm]:
    """The server algorithm class for `algorithm_id` (one class per id for the process)."""
    if algorithm_id not in ALGORITHM_IDS:
        raise ValueError(f"unknown algorithm {algorithm_id!r}; known: {', '.join(ALGORITHM_IDS)}")
    module_name = f"{__name__}.{algorithm_id}"
    if importlib.util.find_spec(module_name) is not None:
        return importlib.import_module(module_name).SERVER
    from .part_sharing import server_for

    return server_for(load_device(algorithm_id))
