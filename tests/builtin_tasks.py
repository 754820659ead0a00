"""The built-in tasks the algorithm tests use, declared directly as `TaskSpec`s, and a device's
share of the digits with that task attached."""

from __future__ import annotations

import dataclasses

from edge_sdk.data import ClientData, load_client_data
from edge_sdk.data.task import TaskSpec

DIGITS = TaskSpec("digits", "image", (1, 8, 8), 10, tuple(str(i) for i in range(10)), (0.3053,), (0.3760,))
"""scikit-learn's digits: 8x8 grayscale images, 10 classes."""


def digits_client(index: int, *, num_clients: int = 10, partition: str = "dirichlet", seed: int = 0,
                  **options) -> ClientData:
    """Device `index`'s part of the digits, its task the `DIGITS` TaskSpec."""
    data = load_client_data("digits", num_clients=num_clients, index=index, partition=partition, seed=seed, **options)
    return dataclasses.replace(data, task=DIGITS)
