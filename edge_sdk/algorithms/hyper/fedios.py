"""FediOS's hyperparameters (`[algorithm.fedios]`, `--set`), without torch: a run's
configuration is checked before the algorithm's module is imported."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

L_RE_FORMS = ("projected", "extractors")
"""Where L_re (Eq. 11) takes its inner product (edge_sdk.algorithms.fedios's Decision): on the
projected features phi_g, phi_p as printed, where it is identically 0, or on the extractors'
outputs before projection (a reconstruction the paper does not print)."""


@dataclass(frozen=True)
class Hyper:
    alpha: float = 0.5  # weight of the generic features in phi_f (Eq. 9)
    lam: float = 0.1  # weight of L_re (Eq. 12), the paper's value; it acts only with l_re="extractors"
    # L_re's inputs (L_RE_FORMS): "projected" is Eq. (11) as printed, identically 0, so the objective is
    # Eq. (10)'s three cross-entropies; "extractors" is the opt-in reconstruction (fedios.py's Decision)
    l_re: Literal["projected", "extractors"] = "projected"
    capacity: int = 0  # number of personal blocks B; 0 = the configured number of clients
    momentum: float = 0.9  # SGD momentum (Appendix B.3)
    # false: Table 7's "w/o personalized extractors": phi_p = 0, phi_f = phi_g, the loss CE(head(phi_g))
    # alone (fedios.py's Decision); alpha, lam and l_re are then unused
    personal_extractor: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must lie in [0, 1], got {self.alpha}")
        if self.lam < 0:
            raise ValueError(f"lam must be >= 0, got {self.lam}")
        if self.l_re not in L_RE_FORMS:
            raise ValueError(f"l_re must be one of {', '.join(L_RE_FORMS)}, got {self.l_re!r}")
        if self.capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {self.capacity}")
