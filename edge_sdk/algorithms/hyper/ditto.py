"""Ditto's hyperparameters (`[algorithm.ditto]`, `--set`), without torch: a run's configuration
is checked before the algorithm's module is imported."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hyper:
    lam: float = 1.0
    """lambda, the weight of the personal objective's term lambda/2 * ||v - w^t||^2 (0: local
    training of the personal model; larger: the personal model stays nearer the global one)."""
    personal_epochs: int | None = None
    """Epochs of the personal model's update per round (the paper's s local iterations); None:
    the run's `local_epochs`, as many as the global model's update."""

    def __post_init__(self) -> None:
        if not self.lam >= 0:
            raise ValueError(f"lam must be zero or more, got {self.lam}")
        if self.personal_epochs is not None and self.personal_epochs < 1:
            raise ValueError(f"personal_epochs must be at least 1, got {self.personal_epochs}")
