"""FedRep's hyperparameters (`[algorithm.fedrep]`, `--set`), without torch: a run's
configuration is checked before the algorithm's module is imported."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hyper:
    head_epochs: int = 10
    """Epochs on the personal head, body frozen, at the start of each local round."""
    body_epochs: int | None = None
    """Epochs on the shared body, head frozen, after the head phase (None: the run's local_epochs)."""
    lr: float | None = None
    """SGD learning rate of both phases (None: the run's lr)."""
    momentum: float = 0.5
    """SGD momentum of both phases (the reference code's; 0.9 was unstable: see edge_sdk/algorithms/fedrep.py)."""

    def __post_init__(self) -> None:
        if self.head_epochs < 0 or (self.body_epochs is not None and self.body_epochs < 0):
            raise ValueError("head_epochs and body_epochs must be 0 or more")
        if self.lr is not None and self.lr <= 0:
            raise ValueError("lr must be positive (or none for the run's lr)")
        if not 0 <= self.momentum < 1:
            raise ValueError("momentum must be in [0, 1)")
