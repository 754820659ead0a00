"""FedALA's hyperparameters (`[algorithm.fedala]`, `--set`), without torch: a run's configuration
is checked before the algorithm's module is imported."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hyper:
    layers: int = 2
    """How many parameter tensors, counted from the model's last (`named_parameters` order), the
    adaptive local aggregation weighs (the paper's top p layers); the lower ones take the global
    model as it is. 2: the weight and bias of a linear head, the paper's p = 1 (the classifier)."""
    sample_percent: float = 80.0
    """s, the share (percent) of the device's training split drawn at random each round to learn
    the aggregation weights on (the paper's default 80)."""
    eta: float = 1.0
    """The aggregation weights' learning rate (the paper's default 1.0)."""
    threshold: float = 0.1
    """In the device's first aggregation the weights learn until the standard deviation of the
    last `window` iterations' losses is below this (the authors' default 0.1)."""
    window: int = 10
    """How many of the latest iteration losses `threshold` is checked over (the authors' 10)."""
    max_iterations: int = 50
    """The most iterations (epochs over the sample) of the first aggregation, converged or not."""

    def __post_init__(self) -> None:
        if self.layers < 1:
            raise ValueError(f"layers must be at least 1, got {self.layers}")
        if not 0 < self.sample_percent <= 100:
            raise ValueError(f"sample_percent must be in (0, 100], got {self.sample_percent}")
        if not self.eta > 0:
            raise ValueError(f"eta must be positive, got {self.eta}")
        if not self.threshold > 0:
            raise ValueError(f"threshold must be positive, got {self.threshold}")
        if self.window < 2:
            raise ValueError(f"window must be at least 2, got {self.window}")
        if self.max_iterations < 1:
            raise ValueError(f"max_iterations must be at least 1, got {self.max_iterations}")
