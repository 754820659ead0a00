"""DualFed: dual representations through a personal projector ("DualFed: Enjoying both
Generalization and Personalization in Federated Learning via Hierarchical Representations",
docs/ALGORITHMS.md, "DualFed").

Model (Sec. 4.1): a shared encoder `body` gives the pre-projection representation z; a personal
`projector` (Linear(d, h)-ReLU-BN-Linear(h, d)-BN, h = d/2 by default, Sec. 5.3) gives the
post-projection representation u; a personal classifier `head` works on u (Eq. 4) and a shared
classifier `global_head` on z (Eq. 3). Inference, Eq. (5): softmax(global_head(z)) +
softmax(head(u)) (`ensemble="prob"`); the official code sums logits (`ensemble="logit"`).

Local round, stage-wise (Sec. 4.2):
(a) `global_head` frozen; `body`, `projector` and `head` train for `local_epochs` epochs on
    CE(head(u)) + lam * SupCon(u), Eq. (6)-(8), with the SupCon "out" form of Eq. (7) over two
    augmented views of every image (`edge_sdk.augment.task_views`); the cross-entropy term is the
    mean over both views.
(b) `body`, `projector` and `head` frozen (the body in evaluation mode, so its BatchNorm
    statistics do not move either); `global_head` trains for `global_head_epochs` epochs on
    CE(global_head(z)), Eq. (9)-(10), with z of the un-augmented training images.
Both stages use SGD, lr 0.01, momentum 0.5 (Sec. 5.3). `lr=none` uses the run's `--lr`.

Ablations (switches, off by default): `schedule="simultaneous"` (Table 4's "Simu.") trains body,
projector, head and global_head together for `local_epochs` epochs with one optimizer on
Eq. (8) + CE(global_head(z)), z of the same augmented views (the mean over both), instead of
(a) then (b); `projector=false` replaces the projector with the identity, so u = z.

Partition: shared = `body` and `global_head` without BatchNorm running statistics; personal =
`projector`, `head` and every BatchNorm running statistic.
Up (TRAIN_RES): group "shared" = body and global_head after the local round, num_examples, loss.
Down (TRAIN and EVALUATE): group "shared" = their server average, Eq. (11): uniform over the
reporting clients as in the paper and the official code (`weighting="uniform"`), or weighted by
examples (`weighting="examples"`).
Metrics: `accuracy` of the ensemble, `global_accuracy` of global_head(body(x)).

Decision (`recalibrate_bn`, default on): at evaluation, after loading the new global body, the
device recomputes its personal BatchNorm statistics (body and projector) on its own
un-augmented training images, with no weight change. Without it the projector's running
statistics describe the previous local body's features: on small clients (a few batches per
round, momentum 0.1) the personal branch then occasionally collapses to one class in
evaluation mode although it is accurate in training mode.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from ..augment import task_views
from ..data.task import TaskSpec
from ..losses import supcon_loss
from ..models import ModelSpec, build_body, seeded_init
from ..models.capabilities import COMMON, PROJECTOR
from ..training import LossFn, accuracy, cross_entropy_loss, eval_mode, predict, recalibrate_batchnorm, run_epochs
from .base import FitResult, Task
from .hyper.dualfed import Hyper
from .torch_device import SHARED, TorchDevice

log = logging.getLogger(__name__)

SHARED_PARTS = ("body", "global_head")
MAIN_BRANCH = ("body", "projector", "head")
ALL_PARTS = (*MAIN_BRANCH, "global_head")


def projector(dim: int, hidden: int) -> nn.Sequential:
    """Linear(d, h)-ReLU-BN-Linear(h, d)-BN (Sec. 5.3)."""
    return nn.Sequential(
        nn.Linear(dim, hidden), nn.ReLU(inplace=True), nn.BatchNorm1d(hidden),
        nn.Linear(hidden, dim), nn.BatchNorm1d(dim),
    )


class DualFedNet(nn.Module):
    """Top-level parts `body`, `projector`, `head` (on u) and `global_head` (on z)."""

    def __init__(self, body: nn.Module, feature_dim: int, num_classes: int, hidden: int | None) -> None:
        """`hidden` None: no projector (the identity, u = z; the ablation `projector=false`)."""
        super().__init__()
        self.body = body
        self.projector = nn.Identity() if hidden is None else projector(feature_dim, hidden)
        self.head = nn.Linear(feature_dim, num_classes)
        self.global_head = nn.Linear(feature_dim, num_classes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(global logits on z, personal logits on u)."""
        z = self.body(x)
        return self.global_head(z), self.head(self.projector(z))


def ensemble(global_logits: torch.Tensor, personal_logits: torch.Tensor, mode: str = "prob") -> torch.Tensor:
    """Eq. (5): the sum of the two classifiers' probabilities (`prob`) or logits (`logit`)."""
    if mode == "prob":
        return F.softmax(global_logits, dim=1) + F.softmax(personal_logits, dim=1)
    if mode == "logit":
        return global_logits + personal_logits
    raise ValueError(f"ensemble must be 'prob' or 'logit', got {mode!r}")


def build_network(model: ModelSpec, task: TaskSpec, hyper: Hyper, seed: int) -> DualFedNet:
    """The same initial network on every device and on the server for the run's seed."""
    with seeded_init(seed):
        body, feature_dim = build_body(model, task)
        hidden = (hyper.projector_hidden or max(1, feature_dim // 2)) if hyper.projector else None
        return DualFedNet(body, feature_dim, task.num_classes, hidden)


def parameters_of(model: nn.Module, parts: tuple[str, ...]) -> list[nn.Parameter]:
    return [p for name in parts for p in getattr(model, name).parameters()]


class DualFedDevice(TorchDevice):
    """Stage (a) trains the main branch, stage (b) the global classifier; both heads predict."""

    id = "dualfed"
    display_name = "DualFed"
    citation = "DualFed"
    table_rank = 90
    paper_method = True
    requires = (*COMMON, PROJECTOR)
    dp_sgd_refusal = ("its supervised contrastive term pairs every example with the others of its batch (and its "
                      "projector normalizes with BatchNorm), so no example has a gradient of its own to clip")
    Hyper = Hyper
    shared_parts = SHARED_PARTS
    model: DualFedNet

    def build_network(self, base: nn.Module) -> DualFedNet:
        """The factory's body (built again, alone, so that a built-in body and the parts DualFed
        adds draw the same initial weights as ever), a projector and the two classifiers."""
        return build_network(self.model_spec, self.data.task, self.hyper, self.settings.seed)

    # -- local training --------------------------------------------------------------------
    def optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        """SGD at `lr` (default the run's) and `momentum` (or the run's common optimizer)."""
        lr = self.settings.lr if self.hyper.lr is None else self.hyper.lr
        return self.local_optimizer(params, lambda own: torch.optim.SGD(own, lr=lr, momentum=self.hyper.momentum))

    def main_branch_loss(self, generator: torch.Generator, *, with_global_head: bool = False) -> LossFn:
        """Eq. (8): CE(head(u)) + lam * SupCon_out(u) over two augmented views of the batch; with
        `with_global_head` (the simultaneous schedule) plus CE(global_head(z)) on the same views."""
        task, model = self.data.task, self.model

        def loss(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            views = task_views(xb, task, generator).flatten(0, 1)
            z = model.body(views)
            u = model.projector(z)
            labels = yb.repeat_interleave(2)
            ce = F.cross_entropy(model.head(u), labels)
            if with_global_head:
                ce = ce + F.cross_entropy(model.global_head(z), labels)
            contrastive = supcon_loss(u.view(len(yb), 2, -1), yb, self.hyper.temperature, variant="out")
            return ce + self.hyper.lam * contrastive

        return loss

    def train_main_branch(self, generator: torch.Generator) -> float:
        """Stage (a): body, projector and head learn; global_head is frozen."""
        self.model.train()
        return run_epochs(self.main_branch_loss(generator), self.optimizer(parameters_of(self.model, MAIN_BRANCH)),
                          self.train_x, self.train_y, epochs=self.settings.local_epochs,
                          batch_size=self.settings.batch_size, generator=generator)

    def train_global_head(self, generator: torch.Generator) -> float:
        """Stage (b): global_head learns on the frozen body's z (Eq. 9-10)."""
        with eval_mode(self.model):
            z = predict(self.model.body, self.train_x)
        head = self.model.global_head
        return run_epochs(cross_entropy_loss(head), self.optimizer(list(head.parameters())), z, self.train_y,
                          epochs=self.hyper.global_head_epochs, batch_size=self.settings.batch_size,
                          generator=generator)

    def train_simultaneously(self, generator: torch.Generator) -> float:
        """The ablation `schedule="simultaneous"`: every part learns at once on both stages' losses."""
        self.model.train()
        return run_epochs(self.main_branch_loss(generator, with_global_head=True),
                          self.optimizer(parameters_of(self.model, ALL_PARTS)), self.train_x, self.train_y,
                          epochs=self.settings.local_epochs, batch_size=self.settings.batch_size, generator=generator)

    def fit(self, task: Task) -> FitResult:
        self.load_shared(task)
        generator = self.generator(task.round)
        if self.hyper.schedule == "simultaneous":
            metrics = {"num_examples": len(self.train_y), "loss": self.train_simultaneously(generator)}
            return FitResult({SHARED: self.shared_state()}, metrics)
        loss = self.train_main_branch(generator)
        head_loss = self.train_global_head(generator)
        metrics = {"num_examples": len(self.train_y), "loss": loss, "global_head_loss": head_loss}
        return FitResult({SHARED: self.shared_state()}, metrics)

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self, task: Task) -> dict[str, float]:
        self.load_shared(task)
        model, mode = self.model, self.hyper.ensemble
        if self.hyper.recalibrate_bn:
            recalibrate_batchnorm(model, self.train_x)

        def both_heads(x: torch.Tensor) -> torch.Tensor:
            global_logits, personal_logits = model(x)
            return ensemble(global_logits, personal_logits, mode)

        with eval_mode(model):
            acc = accuracy(both_heads, self.test_x, self.test_y)
            global_acc = accuracy(lambda x: model.global_head(model.body(x)), self.test_x, self.test_y)
        return {"accuracy": acc, "num_test": len(self.test_y), "global_accuracy": global_acc}


DEVICE = DualFedDevice
