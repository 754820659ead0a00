"""Registry of device-side algorithms: one module per algorithm id, imported on demand.

Importing this package does not import torch; `load` imports the algorithm's module, which
exposes its class as `DEVICE`. The coordinator's registry holds the same ids.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import DeviceAlgorithm

ALGORITHM_IDS: tuple[str, ...] = (
    "local", "fedavg", "fedavg_ft", "fedprox", "fedper", "fedrep", "lg_fedavg",
    "repper", "dualfed", "dc_pfl", "cd2_pfed", "fedios", "ditto", "fedbn", "fedbabu",
    "apfl", "fedrod", "fedproto", "fedala",
)


def load(algorithm_id: str) -> type[DeviceAlgorithm]:
    """The device algorithm class for `algorithm_id`."""
    if algorithm_id not in ALGORITHM_IDS:
        raise ValueError(f"unknown algorithm {algorithm_id!r}; known: {', '.join(ALGORITHM_IDS)}")
    return importlib.import_module(f"{__name__}.{algorithm_id}").DEVICE
