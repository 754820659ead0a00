"""Registry of coordinator-side algorithms; the same ids as `edge_sdk.algorithms`.

Each module exposes its class as `SERVER`. There is no branching on algorithm names anywhere
else: the round loop only calls the `ServerAlgorithm` interface.
"""

from __future__ import annotations

import importlib

from edge_sdk.algorithms import ALGORITHM_IDS


def hyperparameters(algorithm_id: str, values: dict) -> object:
    """The algorithm's Hyper dataclass from `values`, naming any unknown or bad key."""
    from edge_sdk.config import from_mapping

    return from_mapping(load(algorithm_id).Hyper, values, where=f"[algorithm.{algorithm_id}]")


def load(algorithm_id: str) -> type:
    """The server algorithm class for `algorithm_id`."""
    if algorithm_id not in ALGORITHM_IDS:
        raise ValueError(f"unknown algorithm {algorithm_id!r}; known: {', '.join(ALGORITHM_IDS)}")
    return importlib.import_module(f"{__name__}.{algorithm_id}").SERVER
