"""FediOS (Gao, Li, Lu and Wu): generic and personal feature extractors in orthogonal subspaces.

Paper: "FediOS: Decoupling Orthogonal Subspaces for Personalization in Feature-skew Federated
Learning", Sec. 3 and Alg. 1 (appendix); docs/ALGORITHMS.md, "FediOS".

- Parts: generic extractor `body` (shared), personal extractor `personal_body` (same
  architecture, personal), shared classifier `head` on R^D. `FediOSNet` has exactly these three
  top-level children; the projections are its block numbers, never in `state_dict`.
- Eq. (6): the projections are the coordinate blocks of R^D: P^g puts a feature vector in
  coordinates 0..d-1, and client i's P_i puts it in block b_i >= 1 (coordinates b_i d..(b_i+1) d - 1),
  the block the coordinator assigned at registration. D = (B + 1) d, B = the capacity of personal
  blocks. The assignment carries `block` and `capacity`.
  Decision (the projections): a seeded dense Q (the QR of a D x D Gaussian) would be an exact
  change of basis of R^D and nothing else. With logits W phi, the reparameterization V = W Q turns the
  dense-Q model into this one; SGD with momentum, FedAvg (linear) and the orthogonality term are
  all invariant under it, so training is the same up to the head's initial distribution (W's
  i.i.d. uniform entries against their rotation W Q, with the same second moments). What a
  seeded Q costs is real: with cnn28's d = 512 and 20 clients, D = 10,752, and each device
  spent 84 s and 3.4 GB on the QR at join, which OOM-killed the simulation's worker processes
  on Fashion-MNIST.
- Eq. (8)-(9): phi_g = P^g body(x), phi_p = P_i personal_body(x),
  phi_f = alpha phi_g + (1 - alpha) phi_p, alpha = 0.5.
- Eq. (10)-(12): L = CE(head(phi_f)) + CE(head(phi_g)) + CE(head(phi_p)) + lambda * L_re,
  lambda = 0.1, the paper's value for Office-Caltech-10, DomainNet and CIFAR-100 (it uses 0 on
  Digits-Five), L_re = mean_k |a_k . b_k| (Eq. 11).
  Decision (L_re, `l_re`): the default, `l_re = "projected"`, is Eq. (11) as printed, on
  a = phi_g = P^g h_g and b = phi_p = P_i h_p. There it is h_g^T (P^g)^T P_i h_p = 0 for every
  input by Eq. (6) (here exactly: the two blocks share no coordinate), so the term and its
  gradient vanish and the objective is Eq. (10)'s three cross-entropies, whatever lambda. The
  paper's Table 5 (lambda 0.1-50) and Table 7 (without L_re) show the term acting, so the
  paper must compute something else; no official code was found to say what. The opt-in
  `l_re = "extractors"` is a reconstruction: L_re on the extractors' outputs before projection,
  a = body(x), b = personal_body(x) in R^d, the only vectors of Eq. (8) whose orthogonality Eq. (6)
  does not already fix (Sec. 3.2 calls them "the generic and personalized features" the loss is to
  "strengthen the orthogonality" of). The printed form is the default because the reconstruction
  measured worse than no L_re at all, against Table 7's 0.5-1.0 point gain: on Fashion-MNIST
  `domains` (20 devices, C = 0.2, 15 rounds, seeds 0 and 1; benchmarks/docs/papers.md, "Ablations of
  the seed papers") personalized accuracy 75.80 with the reconstruction at lambda 0.1 against
  78.44 with lambda 0 (the printed form's objective); on a 10-device, 10-round federation
  (benchmarks/docs/papers.md, "FediOS's L_re") lambda 0 / 0.01 / 0.1 / 1 gave 77.27 / 76.03 / 74.39 /
  70.12 personalized and 70.81 / 71.56 / 58.50 / 10.27 global accuracy. On the unprojected features
  L_re is about 29 at initialization (cnn28, d = 512, against 3 x 2.3 of CE), and lambda = 1
  drives the generic features to nothing.
- Optimizer: SGD with momentum 0.9 (Appendix B.3), lr from the run's --lr.
- Initialization: `body` and `head` from the federation seed (the same on every device and on
  the server, Alg. 1 line 1); `personal_body` from the device's own seed.

Partition: `body` and `head` are shared (BatchNorm running statistics excepted); `personal_body`
and every running statistic are personal.
Down, each round: the global `body` and `head` (group `shared`). Up: the trained `body` and `head`;
the server averages them weighted by n_k (FedAvg, Alg. 1 lines 19-20).
Deployed model: head(phi_f). `global_accuracy`: head(P^g body(x)) (Sec. 3, inference).

Ablation `personal_extractor=false` (Table 7, "w/o personalized extractors"): `personal_body` is
`ZeroExtractor` (no parameters, zero features), so phi_p = 0, and alpha is taken as 1, so
phi_f = phi_g: the model is head(P^g body(x)), FedAvg through the generic projection.
Decision (the paper gives no equation for the ablation): the objective is
L = CE(head(phi_g)), one cross-entropy, and `alpha`, `lam` and `l_re` are unused. Without a personal
extractor Eq. (10)'s personalized term has no features (kept, CE(head(0)) would train the head's
bias alone toward the device's label frequencies), L_re (Eq. 11) has nothing to be orthogonal
to, and the fused term is the generic term itself (phi_f = phi_g); counted twice it would only
double the step size. Sec. 4.4 reads the ablation as FedAvg plus the projection ("still performs
slightly better than FedAvg ... the projection matrix may map the model parameters into a
subspace"), and with one CE it is exactly that: FedAvg's loss and optimizer (SGD, momentum 0.9)
on a body with a linear head over R^D whose columns outside block 0 see only zeros, so the model
and the loss differ from FedAvg's only in the head's initialization (its own draw, uniform within
1/sqrt(D) rather than 1/sqrt(d)).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..data.task import TaskSpec
from ..models import ModelSpec, PartedNet, build_model, seeded_init
from ..models.capabilities import COMMON, LINEAR_HEAD, TWO_EXTRACTORS
from ..training import LossFn, accuracy, eval_mode, run_epochs
from .base import FitResult, Task
from .hyper.fedios import Hyper
from .torch_device import SHARED, TorchDevice


# -- projections (Eq. 6) --------------------------------------------------------------------
def project(features: torch.Tensor, block: int, dim: int) -> torch.Tensor:
    """P_block f for a batch [B, d]: f in coordinates block d..(block + 1) d - 1 of R^dim, zeros
    elsewhere. Block 0 is the generic P^g."""
    feature_dim = features.shape[1]
    if not 0 <= block < dim // feature_dim:
        raise ValueError(f"block {block} is outside the {dim // feature_dim} blocks of R^{dim}")
    return F.pad(features, (block * feature_dim, dim - (block + 1) * feature_dim))


# -- the model ------------------------------------------------------------------------------
class ZeroExtractor(nn.Module):
    """Zero features of dimension d for any input: the personal extractor of the ablation
    `personal_extractor=false`."""

    def __init__(self, feature_dim: int) -> None:
        super().__init__()
        self.feature_dim = feature_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(len(x), self.feature_dim)


def seeded_body(model: ModelSpec, task: TaskSpec, seed: int) -> tuple[nn.Module, int]:
    """A feature extractor initialized from `seed` (the federation seed gives the generic `body`), and d."""
    net = build_model(model, task, seed=seed)
    assert net.feature_dim is not None  # build_model measured it
    return net.body, net.feature_dim


def shared_head(feature_dim: int, capacity: int, num_classes: int, seed: int) -> nn.Linear:
    """The classifier on R^D, D = (capacity + 1) d, from the federation seed."""
    with seeded_init(seed):
        return nn.Linear((capacity + 1) * feature_dim, num_classes)


class FediOSNet(nn.Module):
    """Children `body`, `personal_body`, `head`; P_i is the personal block number."""

    def __init__(self, body: nn.Module, personal_body: nn.Module, head: nn.Linear, block: int, alpha: float):
        super().__init__()
        self.body = body
        self.personal_body = personal_body
        self.head = head
        self.block = block
        self.alpha = alpha

    def project_generic(self, features: torch.Tensor) -> torch.Tensor:
        """P^g features: into block 0 of R^D."""
        return project(features, 0, self.head.in_features)

    def project_personal(self, features: torch.Tensor) -> torch.Tensor:
        """P_i features: into this device's block of R^D."""
        return project(features, self.block, self.head.in_features)

    def generic_features(self, x: torch.Tensor) -> torch.Tensor:
        """phi_g = P^g body(x) (Eq. 8)."""
        return self.project_generic(self.body(x))

    def personal_features(self, x: torch.Tensor) -> torch.Tensor:
        """phi_p = P_i personal_body(x) (Eq. 8)."""
        return self.project_personal(self.personal_body(x))

    def fuse(self, phi_g: torch.Tensor, phi_p: torch.Tensor) -> torch.Tensor:
        """phi_f = alpha phi_g + (1 - alpha) phi_p (Eq. 9)."""
        return self.alpha * phi_g + (1.0 - self.alpha) * phi_p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Personalized inference: head(phi_f)."""
        return self.head(self.fuse(self.generic_features(x), self.personal_features(x)))

    def global_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The global model: head(P^g body(x))."""
        return self.head(self.generic_features(x))


def orthogonality(generic: torch.Tensor, personal: torch.Tensor) -> torch.Tensor:
    """L_re (Eq. 11): mean over the batch of |generic_k . personal_k|, for the pair of feature
    batches the `l_re` form names (see the Decision above)."""
    return (generic * personal).sum(dim=1).abs().mean()


def fedios_loss(model: FediOSNet, lam: float, l_re: str, personal_extractor: bool = True) -> LossFn:
    """Eq. (10)-(12): three cross-entropies (fused, generic, personal) + lam * L_re, L_re on the
    projected features (`l_re="projected"`, as printed: identically 0) or on the extractors'
    outputs (`"extractors"`); without the personal extractor (Table 7's ablation, the Decision
    above) CE(head(phi_g)) alone."""

    def loss(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        generic = model.body(xb)
        phi_g = model.project_generic(generic)
        if not personal_extractor:
            return F.cross_entropy(model.head(phi_g), yb)
        personal = model.personal_body(xb)
        phi_p = model.project_personal(personal)
        ce = sum(F.cross_entropy(model.head(phi), yb) for phi in (model.fuse(phi_g, phi_p), phi_g, phi_p))
        pair = (generic, personal) if l_re == "extractors" else (phi_g, phi_p)
        return ce + lam * orthogonality(*pair)

    return loss


def parse_assignment(assignment: dict[str, Any]) -> tuple[int, int]:
    """(block, capacity) from the coordinator's assignment; ValueError if it has no block."""
    try:
        block, capacity = int(assignment["block"]), int(assignment["capacity"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"FediOS needs an assignment with integer block and capacity, got {assignment!r}") from None
    if not 1 <= block <= capacity:
        raise ValueError(f"FediOS block {block} is outside 1..{capacity}")
    return block, capacity


class FediOSDevice(TorchDevice):
    """Trains body, personal_body and head jointly; body and head travel."""

    id = "fedios"
    display_name = "FediOS"
    citation = "FediOS"
    table_rank = 120
    paper_method = True
    Hyper = Hyper
    requires = (*COMMON, LINEAR_HEAD, TWO_EXTRACTORS)
    dp_sgd_refusal = None  # Eq. (12): three cross-entropies and L_re, each a mean of per-example terms
    model: FediOSNet  # `build_network`'s
    shared_parts = ("body", "head")

    def build_network(self, base: PartedNet) -> FediOSNet:
        """The factory's model of the federation seed supplies the generic body, the factory's
        model of the device's own seed the personal body; the head is FediOS's linear map on R^D."""
        block, capacity = parse_assignment(self.assignment)
        feature_dim = base.feature_dim
        assert feature_dim is not None  # build_model measured it (`base_model`)
        head = shared_head(feature_dim, capacity, self.data.task.num_classes, self.settings.seed)
        if not self.hyper.personal_extractor:
            return FediOSNet(base.body, ZeroExtractor(feature_dim), head, block, alpha=1.0)
        personal_body, _ = seeded_body(self.model_spec, self.data.task, self.client_seed)
        return FediOSNet(base.body, personal_body, head, block, self.hyper.alpha)

    def local_loss(self) -> LossFn:
        """The objective a local round minimizes: Eq. (12), or CE(head(phi_g)) alone without the
        personal extractor."""
        return fedios_loss(self.model, self.hyper.lam, self.hyper.l_re, self.hyper.personal_extractor)

    def fit(self, task: Task) -> FitResult:
        """Alg. 1 lines 6-16: load the global body and head, minimize Eq. (12) with SGD, send them up."""
        self.load_shared(task)
        self.model.train()
        optimizer = self.local_optimizer(self.model.parameters(), lambda own: torch.optim.SGD(
            own, lr=self.settings.lr, momentum=self.hyper.momentum))
        loss = run_epochs(self.local_loss(), optimizer, self.train_x, self.train_y,
                          epochs=self.settings.local_epochs, batch_size=self.settings.batch_size,
                          generator=self.generator(task.round), module=self.model)
        return FitResult({SHARED: self.shared_state()}, {"num_examples": len(self.train_y), "loss": loss})

    def evaluate(self, task: Task) -> dict[str, float]:
        """Personalized: head(phi_f). Global: head(P^g body(x))."""
        self.load_shared(task)
        with eval_mode(self.model):
            personal = accuracy(self.model, self.test_x, self.test_y)
            generic = accuracy(self.model.global_logits, self.test_x, self.test_y)
        return {"accuracy": personal, "global_accuracy": generic, "num_test": len(self.test_y)}


DEVICE = FediOSDevice
