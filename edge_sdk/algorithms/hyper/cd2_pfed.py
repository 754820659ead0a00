"""CD2-PFed's hyperparameters (`[algorithm.cd2_pfed]`, `--set`), without torch: a run's
configuration is checked before the algorithm's module is imported."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

DISTILLATIONS = ("cyclic+inplace", "inplace", "cyclic")
"""L_CD's forms (edge_sdk.algorithms.cd2_pfed's Decision): Eq. (4) plus in-place distillation, the
in-place term alone, Eq. (4) alone."""


@dataclass(frozen=True)
class Hyper:
    spans_rounds: ClassVar[bool] = True
    """p_t (Eq. 3) and the EMA ramp (Eq. 7) are fractions of the round budget T: a 20-round run
    cut at round 15 is not the 15-round run, so `rounds` defines CD2-pFed's runs (fingerprint)."""

    p: float = 0.5  # maximum personal fraction (Eq. 3)
    ramp: bool = True  # Eq. (3)'s linear increase p_t = p t / T; false: p_t = p from round 1 (Table 5's w/o LI)
    lam: float = 1.0  # weight of the cyclic distillation loss (Eq. 5)
    distillation: Literal["cyclic+inplace", "inplace", "cyclic"] = "cyclic+inplace"  # L_CD's form (DISTILLATIONS)
    beta: float = 0.5  # EMA smoothing coefficient after the ramp-up (Eq. 7)
    warmup: float = 0.1  # t0 = warmup * T (Eq. 7)
    momentum: float = 0.9  # SGD Nesterov momentum (Sec. 4.2)
    weight_decay: float = 5e-4  # (Sec. 4.2)

    def __post_init__(self) -> None:
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"p must lie in [0, 1], got {self.p}")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must lie in [0, 1], got {self.beta}")
        if self.distillation not in DISTILLATIONS:
            raise ValueError(f"distillation must be one of {', '.join(DISTILLATIONS)}, got {self.distillation!r}")
