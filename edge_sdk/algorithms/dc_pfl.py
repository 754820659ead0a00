"""DC-PFL: dual calibration with class statistics (Tang et al., IJCAI 2024), the device side.

Parts and partition: the feature extractor `body` is personal (its architecture may differ
between devices, see `Hyper.body_models`; the feature dimension d must agree), the linear
classifier `head` (phi) is global. BatchNorm running statistics are part of the body, so
personal too. Nothing of the body ever leaves the device.

Down each round: group `shared` = phi (`head.weight`, `head.bias`) and group `global_means`
= the global class means mu_c^t (`means` [C, d] float32) with a mask `has_mean` [C] bool
(all False in the first round, when no means exist yet).

Local work (Sec. 4.1-4.2): load phi^t; train body and head for E epochs on Eq. (4),
CE(head(body(x)), y) + lam * ||body(x) - mu_y||^2 (Eq. 2-3; the squared Euclidean norm,
averaged over all examples, the term being zero for classes without a global mean); then,
with the updated body in evaluation mode, the per-class count n_{c,k}, mean mu_{c,k} (Eq. 6)
and unbiased covariance Sigma_{c,k} (Eq. 7) over the training set, computed in float64.

Up: group `stats` only (never the body, never phi), fixed shapes for C classes:
`counts` [C] int64, `means` [C, d] and, per `Hyper.covariance`,
- `full`: `cov` [C, d, d] (symmetrized before the cast);
- `diag`: `var` [C, d], the diagonal of Sigma_{c,k};
- `lowrank:<r>`: `cov_factor` [C, d, r] = top-r eigenvectors scaled by sqrt(eigenvalue) and
  `cov_residual` [C, d] = the diagonal of what they leave out, so that
  Sigma ~ F F^T + diag(residual), which is PSD by construction and exact on the diagonal.
Means and covariances travel as float32 or float16 (`Hyper.transport`). A class with fewer
than two examples has a zero covariance (Eq. 7 is undefined there; pooling gives it weight 0).

Deployed model: the device's own body with the latest global phi (from EVALUATE).

Decision (local optimizer): SGD with the run's `--lr` and momentum 0.9, where the paper (Sec. 6.1)
says SGD with a fixed learning rate of 0.01 for local and global classifier training. The run's
lr keeps DC-PFL on the learning rate every other method of a run uses (`--lr 0.01` gives the
paper's), and momentum 0.9 is the local optimizer of the other methods whose papers prescribe
SGD with momentum (FediOS, CD2-pFed). The server's classifier steps follow the paper: plain SGD,
`server_lr` 0.01.
"""

from __future__ import annotations

import logging

import numpy as np
import scipy.linalg
import torch
from torch import nn

from ..models import ModelSpec, PartedNet, describe
from ..models.capabilities import COMMON, LINEAR_HEAD
from ..params import ArraySpec
from ..protocol import ArrayGroup
from ..training import LossFn, eval_mode, predict, run_epochs
from .base import FitResult, Task
from .hyper.dc_pfl import CovarianceMode, Hyper
from .torch_device import TorchDevice

log = logging.getLogger(__name__)

GLOBAL_MEANS = "global_means"
"""Down: the global class means `means` [C, d] and the mask `has_mean` [C]."""
STATS = "stats"
"""Up: the class statistics (`counts`, `means` and the covariance arrays of the mode)."""


# -- class statistics (pure numpy; the coordinator uses the same functions) --------------------
def class_statistics(features: np.ndarray, labels: np.ndarray,
                     num_classes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-class counts [C], means [C, d] (Eq. 6) and unbiased covariances [C, d, d] (Eq. 7), float64."""
    features = np.asarray(features, dtype=np.float64)
    dim = features.shape[1]
    counts = np.bincount(labels, minlength=num_classes).astype(np.int64)
    means, covs = np.zeros((num_classes, dim)), np.zeros((num_classes, dim, dim))
    for c in np.flatnonzero(counts):
        z = features[labels == c]
        means[c] = z.mean(axis=0)
        if len(z) >= 2:
            centred = z - means[c]
            cov = centred.T @ centred / (len(z) - 1)
            covs[c] = (cov + cov.T) / 2
    return counts, means, covs


def stats_spec(num_classes: int, dim: int, mode: CovarianceMode, dtype: str) -> ArraySpec:
    """Names, shapes and dtypes of the `stats` group for `mode` and the wire dtype."""
    spec: ArraySpec = {"counts": ((num_classes,), "int64"), "means": ((num_classes, dim), dtype)}
    if mode.kind == "full":
        spec["cov"] = ((num_classes, dim, dim), dtype)
    elif mode.kind == "diag":
        spec["var"] = ((num_classes, dim), dtype)
    else:
        spec["cov_factor"] = ((num_classes, dim, mode.rank), dtype)
        spec["cov_residual"] = ((num_classes, dim), dtype)
    return spec


def _low_rank(cov: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """F [d, r] with F F^T the best rank-r PSD part of `cov`, and the diagonal it leaves out.

    Only the top r eigenpairs are computed (a partial LAPACK solve, several times faster than
    the full one at d = 512), and none for the zero covariance of a class the device lacks."""
    dim = cov.shape[0]
    factor = np.zeros((dim, rank))
    if not cov.any():
        return factor, np.zeros(dim)
    eigenvalues, eigenvectors = scipy.linalg.eigh(cov, subset_by_index=[max(0, dim - rank), dim - 1])  # ascending
    factor[:, : len(eigenvalues)] = eigenvectors[:, ::-1] * np.sqrt(np.clip(eigenvalues[::-1], 0.0, None))
    residual = np.clip(np.diag(cov) - (factor**2).sum(axis=1), 0.0, None)
    return factor, residual


def encode_stats(
    counts: np.ndarray, means: np.ndarray, covs: np.ndarray, mode: CovarianceMode, dtype: str
) -> ArrayGroup:
    """The `stats` group for float64 statistics, in the covariance `mode` and wire `dtype`."""
    group: ArrayGroup = {"counts": counts.astype(np.int64), "means": means.astype(dtype)}
    if mode.kind == "full":
        group["cov"] = covs.astype(dtype)
    elif mode.kind == "diag":
        group["var"] = np.diagonal(covs, axis1=1, axis2=2).astype(dtype)
    else:
        parts = [_low_rank(cov, mode.rank) for cov in covs]
        group["cov_factor"] = np.stack([f for f, _ in parts]).astype(dtype)
        group["cov_residual"] = np.stack([r for _, r in parts]).astype(dtype)
    return group


def decode_stats(group: ArrayGroup, mode: CovarianceMode) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """counts [C] int64, means [C, d] and full covariances [C, d, d], float64, from a `stats` group."""
    counts = np.asarray(group["counts"], dtype=np.int64)
    means = np.asarray(group["means"], dtype=np.float64)
    if mode.kind == "full":
        covs = np.asarray(group["cov"], dtype=np.float64)
    elif mode.kind == "diag":
        covs = _diag_matrices(np.asarray(group["var"], dtype=np.float64))
    else:
        factor = np.asarray(group["cov_factor"], dtype=np.float64)
        residual = np.asarray(group["cov_residual"], dtype=np.float64)
        covs = np.einsum("cdr,cer->cde", factor, factor) + _diag_matrices(residual)
    return counts, means, covs


def _diag_matrices(diagonals: np.ndarray) -> np.ndarray:
    return np.einsum("cd,de->cde", diagonals, np.eye(diagonals.shape[1]))


# -- the device -----------------------------------------------------------------------------
class DcPflDevice(TorchDevice):
    """Personal body, global linear head; trains with the auxiliary loss, uploads class statistics."""

    id = "dc_pfl"
    display_name = "DC-PFL"
    citation = "DC-PFL"
    table_rank = 100
    paper_method = True
    Hyper = Hyper
    requires = (*COMMON, LINEAR_HEAD)
    dp_sgd_refusal = ("its upload is per-class feature statistics (counts, means, covariances) computed directly "
                      "from the training records, not by the DP-SGD steps, so DP-SGD would protect none of it")
    model: PartedNet  # the factory's network: `build_network` is not overridden
    shared_parts = ("head",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        dim, classes = self.model.feature_dim, self.data.task.num_classes
        assert dim is not None  # build_model measured it
        self.means_spec: ArraySpec = {"means": ((classes, dim), "float32"), "has_mean": ((classes,), "bool")}
        log.debug("dc_pfl device with body %s (d=%d)", describe(self.network_spec()), dim)

    def network_spec(self) -> ModelSpec:
        """The body the coordinator assigned this device (`body_models`), else the run's model."""
        return self.assignment.get("model", self.model_spec)

    # -- what travels ----------------------------------------------------------------------
    def global_means(self, task: Task) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(means [C, d], has_mean [C]) on the device, or None when no class has a mean yet."""
        return self.class_values(task, GLOBAL_MEANS, self.means_spec)

    # -- local work ------------------------------------------------------------------------
    def local_loss(self, means: tuple[torch.Tensor, torch.Tensor] | None) -> LossFn:
        """Eq. (4): CE + lam * ||body(x) - mu_y||^2, the second term only for classes with a mean."""
        criterion = nn.CrossEntropyLoss()

        def loss(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            z = self.model.body(xb)
            value = criterion(self.model.head(z), yb)
            if means is not None and self.hyper.lam > 0:
                mu, has_mean = means
                distance = ((z - mu[yb]) ** 2).sum(dim=1) * has_mean[yb]
                value = value + self.hyper.lam * distance.mean()
            return value

        return loss

    def train_locally(self, task: Task) -> float:
        self.model.train()
        generator = self.generator(task.round)
        return run_epochs(
            self.local_loss(self.global_means(task)),
            self.local_optimizer(self.model.parameters(),
                                 lambda own: torch.optim.SGD(own, lr=self.settings.lr, momentum=0.9)),
            self.train_x,
            self.train_y,
            epochs=self.settings.local_epochs,
            batch_size=self.settings.batch_size,
            generator=generator,
        )

    def statistics(self) -> ArrayGroup:
        """Eq. (6)-(7) over the training set with the current body, encoded for the wire."""
        with eval_mode(self.model):
            features = predict(self.model.body, self.train_x).double().cpu().numpy()
        counts, means, covs = class_statistics(features, self.data.train_y, self.data.task.num_classes)
        return encode_stats(counts, means, covs, self.hyper.mode, self.hyper.wire_dtype)

    def fit(self, task: Task) -> FitResult:
        self.load_shared(task)
        loss = self.train_locally(task)
        return FitResult({STATS: self.statistics()}, {"num_examples": len(self.train_y), "loss": loss})

    def evaluate(self, task: Task) -> dict[str, float]:
        self.load_shared(task)
        return {"accuracy": self.test_accuracy(self.model), "num_test": len(self.test_y)}


DEVICE = DcPflDevice
