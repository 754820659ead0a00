"""DualFed's hyperparameters (`[algorithm.dualfed]`, `--set`), without torch: a run's
configuration is checked before the algorithm's module is imported."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Hyper:
    """DualFed's hyperparameters (docs/ALGORITHMS.md, "DualFed"). `lam` is the paper's lambda (Eq. 8).

    Ablation switches (the paper's Table 4 and Sec. 5.3): `schedule="simultaneous"` trains every
    part at once on the sum of both stages' losses instead of stage (a) then stage (b);
    `projector=False` drops the personal projector (u = z: the personal head and SupCon act on
    the shared encoder's output).
    """

    temperature: float = 0.1
    lam: float = 1.0
    lr: float | None = 0.01
    momentum: float = 0.5
    global_head_epochs: int = 1
    projector_hidden: int | None = None
    weighting: Literal["uniform", "examples"] = "uniform"
    ensemble: Literal["prob", "logit"] = "prob"
    recalibrate_bn: bool = True
    schedule: Literal["stagewise", "simultaneous"] = "stagewise"
    projector: bool = True

    def __post_init__(self) -> None:
        if self.temperature <= 0 or self.lam < 0 or (self.lr is not None and self.lr <= 0):
            raise ValueError("temperature and lr must be positive, lam zero or more")
        if not 0 <= self.momentum < 1 or self.global_head_epochs < 1:
            raise ValueError("momentum must be in [0, 1), global_head_epochs at least 1")
        if self.projector_hidden is not None and self.projector_hidden < 1:
            raise ValueError("projector_hidden must be at least 1 (or none for d/2)")
        if self.schedule not in ("stagewise", "simultaneous"):
            raise ValueError(f"schedule must be 'stagewise' or 'simultaneous', got {self.schedule!r}")
        if not self.projector and self.projector_hidden is not None:
            raise ValueError("projector_hidden sizes a projector that projector=false removes")
