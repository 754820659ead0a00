"""APFL's hyperparameters (`[algorithm.apfl]`, `--set`), without torch: a run's configuration
is checked before the algorithm's module is imported."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hyper:
    alpha: float = 0.25
    """The mixing weight alpha of the personalized model alpha * v + (1 - alpha) * w before the
    device first trains (1: the local model v alone; 0: the global model w alone)."""
    adaptive: bool = True
    """Whether alpha learns (a gradient step on the personalized model's loss after every local
    step, projected onto [0, 1]) or stays at `alpha`."""
    alpha_lr: float | None = None
    """Step size of alpha's update; None: the run's lr (the paper steps alpha with the same
    learning rate as the models)."""

    def __post_init__(self) -> None:
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.alpha_lr is not None and not self.alpha_lr > 0:
            raise ValueError(f"alpha_lr must be positive (or none for the run's lr), got {self.alpha_lr}")
