"""The built-in task the algorithm tests use and a device's share of the digits."""

from __future__ import annotations

from edge_sdk.data import BUILTIN_TASKS, ClientData, load_client_data

DIGITS = BUILTIN_TASKS["digits"]
"""scikit-learn's digits: 8x8 grayscale images, 10 classes."""


def digits_client(index: int, *, num_clients: int = 10, partition: str = "dirichlet", seed: int = 0,
                  **options) -> ClientData:
    """Device `index`'s part of the digits."""
    return load_client_data("digits", num_clients=num_clients, index=index, partition=partition, seed=seed, **options)
