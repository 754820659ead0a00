"""FedAvg+FT's hyperparameters (`[algorithm.fedavg_ft]`, `--set`), without torch: a run's
configuration is checked before the algorithm's module is imported."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hyper:
    ft_epochs: int = 10
    """Epochs of head fine-tuning before each evaluation (on a copy of the model)."""
