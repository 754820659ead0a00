"""FedProx's hyperparameters (`[algorithm.fedprox]`, `--set`), without torch: a run's
configuration is checked before the algorithm's module is imported."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hyper:
    mu: float = 0.01
    """Weight of the proximal term mu/2 * ||w - w_global||^2 (0 gives FedAvg)."""
