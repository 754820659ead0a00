"""DC-PFL's hyperparameters (`[algorithm.dc_pfl]`, `--set`), without torch: a run's
configuration is checked before the algorithm's module is imported."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


_WIRE_DTYPES = {"fp32": "float32", "fp16": "float16"}


@dataclass(frozen=True)
class CovarianceMode:
    """A parsed `Hyper.covariance`: `full`, `diag`, or `lowrank` with its rank."""

    kind: str
    rank: int = 0

    @classmethod
    def parse(cls, text: str) -> CovarianceMode:
        if text in ("full", "diag"):
            return cls(text)
        head, sep, rank = text.partition(":")
        if head == "lowrank" and sep and rank.isdigit() and int(rank) >= 1:
            return cls("lowrank", int(rank))
        raise ValueError(f"covariance must be 'full', 'diag' or 'lowrank:<r>' with r >= 1, got {text!r}")


@dataclass(frozen=True)
class Hyper:
    """DC-PFL hyperparameters, defaults from the paper (Sec. 6.1, Table 3); docs/ALGORITHMS.md, "DC-PFL".

    Neither gives lambda: 0.01 is ours. The auxiliary term is a squared norm summed over the d
    features, so its scale grows with d; on digits (cnn8, d = 128, SGD lr 0.05) lambda = 0.1 or
    1 collapses the features to zero within two rounds, 0.01 does not.
    """

    lam: float = 0.01
    """Weight of the auxiliary loss ||body(x) - mu_y||^2 (Eq. 4)."""
    covariance: str = "full"
    """`full`, `diag` or `lowrank:<r>`: how Sigma_{c,k} travels."""
    transport: Literal["fp32", "fp16"] = "fp32"
    """Dtype of the uploaded means and covariances."""
    virtual_features: int = 1000
    """sum_c |G_c|, the virtual features drawn per round (Table 3)."""
    server_lr: float = 0.01
    """eta_phi, the SGD learning rate of phi on the server (Eq. 8 and 12; Sec. 6.1)."""
    calibration_epochs: int = 1
    """Epochs of Eq. (12) over the virtual features each round (the paper leaves it open)."""
    calibration_batch_size: int = 32
    """Mini-batch size of Eq. (12)."""
    body_models: str = ""
    """Comma-separated models (built-in names or import paths of factories) whose bodies are
    assigned round-robin in registration order; empty: the run's model."""

    def __post_init__(self) -> None:
        CovarianceMode.parse(self.covariance)
        if self.lam < 0 or self.server_lr <= 0:
            raise ValueError("lam must be >= 0 and server_lr > 0")
        if self.virtual_features < 0 or self.calibration_epochs < 0 or self.calibration_batch_size < 1:
            raise ValueError("virtual_features and calibration_epochs must be >= 0, calibration_batch_size >= 1")

    @property
    def mode(self) -> CovarianceMode:
        return CovarianceMode.parse(self.covariance)

    @property
    def wire_dtype(self) -> str:
        return _WIRE_DTYPES[self.transport]

    def body_model_names(self) -> list[str]:
        return [name.strip() for name in self.body_models.split(",") if name.strip()]
