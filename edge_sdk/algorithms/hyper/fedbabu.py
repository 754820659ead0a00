"""FedBABU's hyperparameters (`[algorithm.fedbabu]`, `--set`), without torch: a run's
configuration is checked before the algorithm's module is imported."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hyper:
    finetune_epochs: int = 5
    """Epochs of whole-model fine-tuning before each evaluation, on a copy of the model (the paper's tau_f = 5)."""

    def __post_init__(self) -> None:
        if self.finetune_epochs < 0:
            raise ValueError("finetune_epochs must be 0 or more")
