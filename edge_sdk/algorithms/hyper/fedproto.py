"""FedProto's hyperparameters (`[algorithm.fedproto]`, `--set`), without torch: a run's
configuration is checked before the algorithm's module is imported."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hyper:
    """FedProto hyperparameters; docs/ALGORITHMS.md, "FedProto".

    lambda = 1 is the paper's (the official code's `ld` default; FediOS's comparison uses 1.0 "as
    suggested in the paper"). It weighs the official code's prototype term, the mean squared error
    over the batch and the d features, so its scale does not grow with d.
    """

    lam: float = 1.0
    """lambda, the weight of the prototype term L_R (Eq. 7): 0 is local training with uploads."""
    body_models: str = ""
    """Comma-separated models (built-in names or import paths of factories) assigned round-robin
    in registration order, as DC-PFL's; empty: the run's model. Their feature dimensions must agree."""

    def __post_init__(self) -> None:
        if not self.lam >= 0:
            raise ValueError(f"lam must be zero or more, got {self.lam}")

    def body_model_names(self) -> list[str]:
        return [name.strip() for name in self.body_models.split(",") if name.strip()]
