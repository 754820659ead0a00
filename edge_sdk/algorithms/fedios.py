"""FediOS (Yan et al.): generic and personal feature extractors in orthogonal subspaces.

Paper: papers/fedios.txt, Sec. 3 and Alg. 1 (appendix).

- Parts: generic extractor `body` (shared), personal extractor `personal_body` (same
  architecture, personal), shared classifier `head` on R^D. `FediOSNet` has exactly these three
  top-level children; the projections are non-persistent buffers (never in `state_dict`).
- Eq. (6): Q is a D x D orthogonal matrix drawn from the federation seed (QR of a Gaussian, the
  signs fixed so that diag(R) > 0, hence the same Q on every side); P^g = Q[:, 0:d] and client i
  uses P_i = Q[:, b_i d:(b_i + 1) d] with the block b_i >= 1 that the coordinator assigned at
  registration. D = (B + 1) d, B = the capacity of personal blocks. The assignment carries
  `block`, `capacity` and `seed`; Q itself never travels.
- Eq. (8)-(9): phi_g = P^g body(x), phi_p = P_i personal_body(x),
  phi_f = alpha phi_g + (1 - alpha) phi_p, alpha = 0.5.
- Eq. (10)-(12): L = CE(head(phi_f)) + CE(head(phi_g)) + CE(head(phi_p))
  + lambda * mean_k |phi_g . phi_p|, lambda = 1 (ALGORITHMS.md; the paper uses 0.1, and 0 on
  Digits-Five). With exactly orthogonal P^g and P_i the inner product vanishes up to rounding.
- Optimizer: SGD with momentum 0.9 (Appendix B.3), lr from the run's --lr.
- Initialization: `body` and `head` from the federation seed (the same on every device and on
  the server, Alg. 1 line 1); `personal_body` from the device's own seed.

Partition: `body` and `head` are shared (BatchNorm running statistics excepted); `personal_body`
and every running statistic are personal.
Down, each round: the global `body` and `head` (group `shared`). Up: the trained `body` and `head`;
the server averages them weighted by n_k (FedAvg, Alg. 1 lines 19-20).
Deployed model: head(phi_f). `global_accuracy`: head(P^g body(x)) (Sec. 3, inference).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..data import DatasetMeta
from ..models import build_model
from ..training import LossFn, accuracy, eval_mode
from .base import Task
from .part_sharing import PartSharingDevice

Q_STREAM = 0xF1D105
"""Second word of the seed of Q's Gaussian draw, so that Q has a random stream of its own."""


@dataclass(frozen=True)
class Hyper:
    alpha: float = 0.5  # weight of the generic features in phi_f (Eq. 9)
    lam: float = 1.0  # weight of the orthogonality regularizer (Eq. 12)
    capacity: int = 0  # number of personal blocks B; 0 = the configured number of clients
    momentum: float = 0.9  # SGD momentum (Appendix B.3)

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must lie in [0, 1], got {self.alpha}")
        if self.capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {self.capacity}")


# -- projections (Eq. 6) --------------------------------------------------------------------
def orthogonal_columns(dim: int, columns: int, seed: int) -> np.ndarray:
    """The first `columns` columns of Q, the dim x dim orthogonal matrix of Eq. (6) for `seed`.

    Q is the Q factor of the QR of a dim x dim Gaussian with the signs fixed so that diag(R) > 0.
    Its first k columns depend only on the first k columns of the Gaussian and equal the Q factor
    of their reduced QR, so a device computes only the columns up to its own block. The
    factorization runs in torch under its thread settings (numpy's multi-threaded OpenBLAS took
    minutes for D = 1408 on a loaded two-core machine).
    """
    if not 1 <= columns <= dim:
        raise ValueError(f"columns must lie in 1..{dim}, got {columns}")
    gaussian = np.random.default_rng((seed, Q_STREAM)).standard_normal((dim, dim))
    q, r = torch.linalg.qr(torch.from_numpy(np.ascontiguousarray(gaussian[:, :columns])))
    return (q * torch.where(torch.diagonal(r) < 0, -1.0, 1.0)).numpy()


def projection(q: np.ndarray, block: int, feature_dim: int) -> np.ndarray:
    """P_b = Q[:, b d:(b + 1) d] (D x d) from (a prefix of) Q; block 0 is the generic P^g."""
    if not 0 <= block < q.shape[1] // feature_dim:
        raise ValueError(f"block {block} is outside the {q.shape[1] // feature_dim} blocks given")
    return q[:, block * feature_dim:(block + 1) * feature_dim]


# -- the model ------------------------------------------------------------------------------
def seeded_body(model: str, meta: DatasetMeta, seed: int) -> tuple[nn.Module, int]:
    """A feature extractor initialized from `seed` (the federation seed gives the generic `body`), and d."""
    net = build_model(model, in_channels=meta.channels, num_classes=meta.num_classes,
                      image_size=meta.image_size, seed=seed)
    return net.body, net.feature_dim


def shared_head(feature_dim: int, capacity: int, num_classes: int, seed: int) -> nn.Linear:
    """The classifier on R^D, D = (capacity + 1) d, from the federation seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear((capacity + 1) * feature_dim, num_classes)


class FediOSNet(nn.Module):
    """Children `body`, `personal_body`, `head`; P^g and P_i as non-persistent buffers."""

    def __init__(self, body: nn.Module, personal_body: nn.Module, head: nn.Module,
                 generic_projection: np.ndarray, personal_projection: np.ndarray, alpha: float):
        super().__init__()
        self.body = body
        self.personal_body = personal_body
        self.head = head
        self.alpha = alpha
        # Stored transposed ([d, D]) so that phi = features @ P^T for a batch.
        self.register_buffer("generic_t", torch.tensor(generic_projection.T, dtype=torch.float32), persistent=False)
        self.register_buffer("personal_t", torch.tensor(personal_projection.T, dtype=torch.float32), persistent=False)

    def generic_features(self, x: torch.Tensor) -> torch.Tensor:
        """phi_g = P^g body(x) (Eq. 8)."""
        return self.body(x) @ self.generic_t

    def personal_features(self, x: torch.Tensor) -> torch.Tensor:
        """phi_p = P_i personal_body(x) (Eq. 8)."""
        return self.personal_body(x) @ self.personal_t

    def fuse(self, phi_g: torch.Tensor, phi_p: torch.Tensor) -> torch.Tensor:
        """phi_f = alpha phi_g + (1 - alpha) phi_p (Eq. 9)."""
        return self.alpha * phi_g + (1.0 - self.alpha) * phi_p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Personalized inference: head(phi_f)."""
        return self.head(self.fuse(self.generic_features(x), self.personal_features(x)))

    def global_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The global model: head(P^g body(x))."""
        return self.head(self.generic_features(x))


def fedios_loss(model: FediOSNet, lam: float) -> LossFn:
    """Eq. (10)-(12): three cross-entropies (fused, generic, personal) + lam * mean |phi_g . phi_p|."""

    def loss(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        phi_g, phi_p = model.generic_features(xb), model.personal_features(xb)
        ce = sum(F.cross_entropy(model.head(phi), yb) for phi in (model.fuse(phi_g, phi_p), phi_g, phi_p))
        return ce + lam * (phi_g * phi_p).sum(dim=1).abs().mean()

    return loss


def parse_assignment(assignment: dict[str, Any], default_seed: int) -> tuple[int, int, int]:
    """(block, capacity, seed) from the coordinator's assignment; ValueError if it has no block."""
    try:
        block, capacity = int(assignment["block"]), int(assignment["capacity"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"FediOS needs an assignment with integer block and capacity, got {assignment!r}") from None
    if not 1 <= block <= capacity:
        raise ValueError(f"FediOS block {block} is outside 1..{capacity}")
    return block, capacity, int(assignment.get("seed", default_seed))


class FediOSDevice(PartSharingDevice):
    """Trains body, personal_body and head jointly; body and head travel."""

    id = "fedios"
    Hyper = Hyper
    shared_parts = ("body", "head")

    def build_network(self) -> FediOSNet:
        block, capacity, seed = parse_assignment(self.assignment, self.settings.seed)
        meta = self.data.meta
        # The PartedNet of the federation seed supplies the generic body.
        generic = super().build_network()
        body, feature_dim = generic.body, generic.feature_dim
        personal_body, _ = seeded_body(self.settings.model, meta, self.client_seed)
        q = orthogonal_columns((capacity + 1) * feature_dim, (block + 1) * feature_dim, seed)
        return FediOSNet(
            body, personal_body, shared_head(feature_dim, capacity, meta.num_classes, self.settings.seed),
            projection(q, 0, feature_dim), projection(q, block, feature_dim), self.hyper.alpha,
        )

    def optimizer(self, params=None) -> torch.optim.Optimizer:
        params = self.model.parameters() if params is None else params
        return torch.optim.SGD(params, lr=self.settings.lr, momentum=self.hyper.momentum)

    def local_loss(self, task: Task) -> LossFn:
        return fedios_loss(self.model, self.hyper.lam)

    def evaluate(self, task: Task) -> dict[str, float]:
        """Personalized: head(phi_f). Global: head(P^g body(x))."""
        self.load_shared(task)
        with eval_mode(self.model):
            personal = accuracy(self.model, self.test_x, self.test_y)
            generic = accuracy(self.model.global_logits, self.test_x, self.test_y)
        return {"accuracy": personal, "global_accuracy": generic, "num_test": len(self.test_y)}


DEVICE = FediOSDevice
