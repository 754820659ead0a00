"""FediOS's hyperparameters (`[algorithm.fedios]`, `--set`), without torch: a run's
configuration is checked before the algorithm's module is imported."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hyper:
    alpha: float = 0.5  # weight of the generic features in phi_f (Eq. 9)
    lam: float = 0.1  # weight of L_re (Eq. 12); the paper's value (ALGORITHMS.md: 1, see fedios.py's Decision)
    capacity: int = 0  # number of personal blocks B; 0 = the configured number of clients
    momentum: float = 0.9  # SGD momentum (Appendix B.3)
    # false: Table 7's "w/o personalized extractors": phi_p = 0, phi_f = phi_g, the loss CE(head(phi_g))
    # alone (fedios.py's Decision); alpha and lam are then unused
    personal_extractor: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must lie in [0, 1], got {self.alpha}")
        if self.capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {self.capacity}")
