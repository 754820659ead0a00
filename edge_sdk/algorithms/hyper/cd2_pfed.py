"""CD2-PFed's hyperparameters (`[algorithm.cd2_pfed]`, `--set`), without torch: a run's
configuration is checked before the algorithm's module is imported."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hyper:
    p: float = 0.5  # maximum personal fraction (Eq. 3)
    lam: float = 1.0  # weight of the cyclic distillation loss (Eq. 5)
    beta: float = 0.5  # EMA smoothing coefficient after the ramp-up (Eq. 7)
    warmup: float = 0.1  # t0 = warmup * T (Eq. 7)
    momentum: float = 0.9  # SGD Nesterov momentum (Sec. 4.2)
    weight_decay: float = 5e-4  # (Sec. 4.2)

    def __post_init__(self) -> None:
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"p must lie in [0, 1], got {self.p}")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must lie in [0, 1], got {self.beta}")
