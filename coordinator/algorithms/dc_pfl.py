"""DC-PFL (Tang et al., IJCAI 2024), server side: a global linear classifier phi from class statistics.

The server holds phi (`shared`: `head.weight` [C, d], `head.bias` [C]) and the global class
means (`global_means`: `means` [C, d], `has_mean` [C]); it never holds a body. Devices upload
only per-class counts, means and covariances (`stats`, see `edge_sdk.algorithms.dc_pfl`).

Each round (Algorithm 1), over the reporting clients in client-id order (so the result does
not depend on arrival order):
1. one SGD step on phi per client with the mean CE of phi on that client's class means over
   the classes it has (Eq. 8-9);
2. the pooled global mean and unbiased covariance of every class (Eq. 10-11,
   `coordinator.aggregation.averaging.pool_class_stats`);
3. virtual features G_c ~ N(mu_c, Sigma_c), |G_c| proportional to the class's global count
   (largest remainders, so sum |G_c| = `virtual_features` exactly), drawn with a generator
   seeded by (run seed, round);
4. `calibration_epochs` of mini-batch SGD on CE of phi over the virtual features (Eq. 12).
Down next round: phi^{t+1} and mu^{t+1}. A class that no reporting client has keeps its
previous mean (and stays without one until first seen). EVALUATE carries phi only.

Heterogeneous bodies: `Hyper.body_models` names the architectures (model factories, resolved as
the run's model is), handed out round-robin in registration order by `assignment` (a
simulation's coordinator hands them to its roster first, in device index order); each must
have DC-PFL's capabilities and the feature dimension of the run's model.
The order lives in memory: a coordinator restarted from a checkpoint hands them out anew.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from edge_sdk.algorithms.dc_pfl import (
    GLOBAL_MEANS,
    STATS,
    DcPflDevice,
    decode_stats,
    stats_spec,
)
from edge_sdk.algorithms.hyper.dc_pfl import Hyper as DcPflHyper
from edge_sdk.algorithms.torch_device import SHARED
from edge_sdk.models import seeded_init
from edge_sdk.params import ArraySpec
from edge_sdk.protocol import ArrayGroup, Reason, ValidationError

from ..aggregation.averaging import pool_class_stats
from ..privacy.policy import CLASS_STATISTICS
from .base import ServerAlgorithm, ServerContext
from .body_models import BodyModels

log = logging.getLogger(__name__)

HEAD_WEIGHT, HEAD_BIAS = "head.weight", "head.bias"


def virtual_counts(counts: np.ndarray, total: int) -> np.ndarray:
    """|G_c| proportional to `counts`, summing to `total` (largest remainders; ties to the lower class)."""
    counts = np.asarray(counts, dtype=np.float64)
    if counts.sum() <= 0:
        return np.zeros(len(counts), dtype=np.int64)
    quota = total * counts / counts.sum()
    sizes = np.floor(quota).astype(np.int64)
    remainders = quota - sizes
    order = np.argsort(-remainders, kind="stable")
    sizes[order[: total - int(sizes.sum())]] += 1
    return sizes


def sample_virtual_features(
    means: np.ndarray, covs: np.ndarray, sizes: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Features [sum sizes, d] float32 drawn from N(means[c], covs[c]) and their labels int64.

    Sampling goes through the eigendecomposition with negative eigenvalues (rounding) clipped to
    zero, so singular covariances (fewer examples than dimensions) are fine.
    """
    features, labels = [], []
    for c in np.flatnonzero(sizes):
        eigenvalues, eigenvectors = np.linalg.eigh(covs[c])
        scale = eigenvectors * np.sqrt(np.clip(eigenvalues, 0.0, None))
        noise = rng.standard_normal((int(sizes[c]), means.shape[1]))
        features.append(means[c] + noise @ scale.T)
        labels.append(np.full(int(sizes[c]), c, dtype=np.int64))
    if not features:
        return np.zeros((0, means.shape[1]), dtype=np.float32), np.zeros(0, dtype=np.int64)
    return np.concatenate(features).astype(np.float32), np.concatenate(labels)


def check_psd(name: str, covs: np.ndarray) -> None:
    """Every [d, d] matrix in `covs` symmetric and with eigenvalues >= -tol, else ValidationError.

    tol bounds the rounding of a PSD matrix cast to the wire dtype: ||E||_2 <= eps sqrt(d) ||S||_2
    (eps of that dtype), plus d times its smallest subnormal for the entries that underflow.
    """
    covs = np.asarray(covs)
    info, dim = np.finfo(covs.dtype), covs.shape[-1]
    for c, cov in enumerate(covs.astype(np.float64)):
        if not cov.any():  # a class the device lacks (or saw once): zero, PSD, and no eigensolver needed
            continue
        eigenvalues = np.linalg.eigvalsh((cov + cov.T) / 2)
        tol = info.eps * np.sqrt(dim) * np.abs(eigenvalues).max() + dim * info.smallest_subnormal
        if np.abs(cov - cov.T).max() > tol:
            raise ValidationError(Reason.MALFORMED, f"{name}[{c}] is not symmetric")
        if eigenvalues[0] < -tol:
            raise ValidationError(Reason.MALFORMED, f"{name}[{c}] is not PSD (eigenvalue {eigenvalues[0]:.3g})")


class DcPflServer(ServerAlgorithm):
    """Holds phi and the global class means; learns phi from client statistics and virtual features."""

    id = "dc_pfl"
    Hyper = DcPflHyper
    unshardable = ("its server keeps every device's class statistics of the round and fits the classifier on "
                   "features drawn from all of them at once")
    asynchronous = unshardable
    lossy_uploads = ("its class covariances must arrive positive semi-definite, and a codec's rounding of their "
                     "change leaves negative eigenvalues (upload_codec fp32; --set transport=fp16 halves the "
                     "statistics' bytes, checked at their own precision)")

    def __init__(self, hyper: DcPflHyper, context: ServerContext):
        self.num_classes = context.task.num_classes
        self.bodies = BodyModels(hyper.body_model_names(), DcPflDevice, context)
        self.dim = self.bodies.dim
        self._reports: dict[str, ArrayGroup] = {}
        super().__init__(hyper, context)

    # -- state and what travels --------------------------------------------------------------
    def initial_state(self) -> dict[str, ArrayGroup]:
        with seeded_init(self.context.seed):
            head = nn.Linear(self.dim, self.num_classes)
        means = {
            "means": np.zeros((self.num_classes, self.dim), np.float32),
            "has_mean": np.zeros(self.num_classes, bool),
        }
        return {SHARED: _head_arrays(head), GLOBAL_MEANS: means}

    def eval_groups(self) -> dict[str, ArrayGroup]:
        return {SHARED: self.state[SHARED]}

    def assignment(self, client_id: str) -> dict[str, str]:
        return self.bodies.assignment(client_id)

    def update_spec(self, round_: int) -> dict[str, ArraySpec]:
        return {STATS: stats_spec(self.num_classes, self.dim, self.hyper.mode, self.hyper.wire_dtype)}

    def upload_kinds(self) -> dict[str, str]:
        return {STATS: CLASS_STATISTICS}

    def validate_update(self, client_id: str, groups: dict[str, ArrayGroup], metrics: dict[str, float],
                        registered_examples: int) -> None:
        stats = groups[STATS]
        for name, array in stats.items():
            if array.dtype.kind == "f" and not np.isfinite(array).all():
                raise ValidationError(Reason.NON_FINITE, f"{client_id}: stats/{name} has non-finite values")
        counts = np.asarray(stats["counts"])
        if (counts < 0).any() or int(counts.sum()) > registered_examples:
            raise ValidationError(
                Reason.MALFORMED,
                f"{client_id}: class counts {counts.tolist()} for {registered_examples} registered examples",
            )
        if "cov" in stats:
            check_psd(f"{client_id}: stats/cov", stats["cov"])
        for name in ("var", "cov_residual"):
            if name in stats and (np.asarray(stats[name]) < 0).any():
                raise ValidationError(Reason.MALFORMED, f"{client_id}: stats/{name} has negative variances")

    # -- aggregation ---------------------------------------------------------------------------
    def begin_round(self, round_: int) -> None:
        self._reports = {}

    def accumulate(self, client_id: str, groups: dict[str, ArrayGroup], metrics: dict[str, float],
                   weight: float) -> None:
        self._reports[client_id] = {name: np.array(value) for name, value in groups[STATS].items()}

    def end_round(self, round_: int) -> None:
        reports = [decode_stats(self._reports[cid], self.hyper.mode) for cid in sorted(self._reports)]
        if not reports:
            log.warning("dc_pfl round %d: no statistics; global state unchanged", round_)
            return
        head = _load_head(self.state[SHARED])
        optimizer = torch.optim.SGD(head.parameters(), lr=self.hyper.server_lr)
        for counts, means, _ in reports:
            _classifier_step(head, optimizer, counts, means)
        counts, means, covs = self.pooled(reports)
        sizes = virtual_counts(counts, self.hyper.virtual_features)
        rng = np.random.default_rng([self.context.seed, round_])
        features, labels = sample_virtual_features(means, covs, sizes, rng)
        loss = self._calibrate(head, optimizer, features, labels, round_)
        seen = counts > 0
        previous = self.state[GLOBAL_MEANS]
        self.state = {
            SHARED: _head_arrays(head),
            GLOBAL_MEANS: {
                "means": np.where(seen[:, None], means, previous["means"]).astype(np.float32),
                "has_mean": previous["has_mean"] | seen,
            },
        }
        log.info("dc_pfl round %d: %d reports, %d classes seen, %d virtual features, calibration loss %.4f",
                 round_, len(reports), int(seen.sum()), len(labels), loss)

    def pooled(self, reports: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, ...]:
        """Global counts [C], means [C, d], covariances [C, d, d] (Eq. 10-11) of a non-empty list of reports."""
        per_class = [pool_class_stats([(n[c], m[c], s[c]) for n, m, s in reports]) for c in range(self.num_classes)]
        counts = np.array([count for count, _, _ in per_class], dtype=np.int64)
        return counts, np.stack([mean for _, mean, _ in per_class]), np.stack([cov for _, _, cov in per_class])

    def _calibrate(self, head: nn.Linear, optimizer: torch.optim.Optimizer, features: np.ndarray,
                   labels: np.ndarray, round_: int) -> float:
        """Eq. (12): mini-batch SGD on CE of phi over the virtual features; the last epoch's mean loss."""
        if len(labels) == 0:
            return float("nan")
        x, y = torch.from_numpy(features), torch.from_numpy(labels)
        generator = torch.Generator().manual_seed(self.context.seed * 100_003 + round_)
        criterion = nn.CrossEntropyLoss()
        batch = self.hyper.calibration_batch_size
        mean_loss = float("nan")
        for _ in range(self.hyper.calibration_epochs):
            order, total = torch.randperm(len(y), generator=generator), 0.0
            for start in range(0, len(y), batch):
                idx = order[start:start + batch]
                optimizer.zero_grad(set_to_none=True)
                loss = criterion(head(x[idx]), y[idx])
                loss.backward()
                optimizer.step()
                total += float(loss.detach()) * len(idx)
            mean_loss = total / len(y)
        return mean_loss


def _classifier_step(head: nn.Linear, optimizer: torch.optim.Optimizer, counts: np.ndarray, means: np.ndarray) -> None:
    """Eq. (8)-(9): one step on the mean CE of phi over the client's class means."""
    present = np.flatnonzero(counts > 0)
    if len(present) == 0:
        return
    optimizer.zero_grad(set_to_none=True)
    logits = head(torch.as_tensor(means[present], dtype=torch.float32))
    nn.functional.cross_entropy(logits, torch.as_tensor(present)).backward()
    optimizer.step()


def _load_head(arrays: ArrayGroup) -> nn.Linear:
    weight = arrays[HEAD_WEIGHT]
    head = nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        head.weight.copy_(torch.as_tensor(np.array(weight)))
        head.bias.copy_(torch.as_tensor(np.array(arrays[HEAD_BIAS])))
    return head


def _head_arrays(head: nn.Linear) -> ArrayGroup:
    return {HEAD_WEIGHT: head.weight.detach().numpy().copy(), HEAD_BIAS: head.bias.detach().numpy().copy()}


SERVER = DcPflServer
