"""RepPer's hyperparameters (`[algorithm.repper]`, `--set`), without torch: a run's
configuration is checked before the algorithm's module is imported."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

HeadKind = Literal["linear", "mlp", "svm", "lr", "mlp_sklearn"]


@dataclass(frozen=True)
class Hyper:
    """RepPer's hyperparameters (docs/ALGORITHMS.md, "RepPer"); `lr` is Adam's in stage 1 (eta_r)."""

    variant: Literal["in", "out"] = "out"
    temperature: float = 0.1
    lr: float = 1e-3
    weight_decay: float = 1e-4
    head: HeadKind = "linear"
    head_epochs: int = 10
    head_hidden: int = 128
    projection_dim: int = 0
    normalize_features: bool = False
    recalibrate_bn: bool = True

    def __post_init__(self) -> None:
        if self.temperature <= 0 or self.lr <= 0 or self.weight_decay < 0:
            raise ValueError("temperature and lr must be positive, weight_decay zero or more")
        if self.head_epochs < 1 or self.head_hidden < 1 or self.projection_dim < 0:
            raise ValueError("head_epochs and head_hidden must be at least 1, projection_dim zero or more")
