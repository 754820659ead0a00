"""RepPer: common representation first, personal heads second (Jing et al., AAAI 2023,
"A Closer Look at Personalization in Federated Image Classification"; docs/ALGORITHMS.md, "RepPer").

Stage 1, CRL (every training round, 1..T): a selected device loads the global `body`, draws two
augmented views of every training image (`edge_sdk.augment.task_views`) and minimizes the
supervised contrastive loss of Eq. (4)-(5) on z = r / ||r||, r = body(x) (`supcon_loss`,
variant "out" = Khosla et al.'s Eq. 2, the 1/|P(j)| average outside the log; "in" = Eq. (5) as
printed, the average inside; see the Decision below), temperature 0.1, Adam with lr 1e-3 and
weight decay 1e-4 (Sec. 6.1). Labels only define the positives: no classifier exists in stage 1.
The server takes the example-weighted mean of the uploaded bodies, Eq. (8).

Stage 2, PCL (every evaluation, Eq. (6) and (9)): the body is frozen. Every device, selected or
not (held-out devices included), loads the latest global body and fits a personal head on the
features of its own training split: `linear` or `mlp` in torch (cross-entropy, `head_epochs`
epochs of SGD with momentum 0.9 and the run's `--lr`, the paper's eta_c, on standardized
features: `fit_torch_head`), or `svm` (linear), `lr` (logistic regression) or `mlp_sklearn`
(one hidden layer, Adam), the numpy heads weak devices fit (`edge_sdk.lite.heads`;
`mlp_sklearn` is its `mlp`). It reports the test accuracy of that head. Intermediate
evaluations are the same procedure: a probe of the current body.

Partition: shared = `body` (and `projector` when `projection_dim` > 0) including the body's
BatchNorm running statistics (Decision below); personal: nothing but the head, which is
refitted at every evaluation and kept in memory only (`head`).
Up (TRAIN_RES): group "shared" = the body after local training, and num_examples, loss.
Down (TRAIN and EVALUATE): group "shared" = the global body. In stage 2 only metrics go up.

Decisions where the paper is open:
- The loss form: Eq. (5) is printed in the "in" form (`variant="in"`); the default here is
  `"out"` because "in" measurably fails the paper's own aim. Its log-mean-exp over positives is
  minimized by the single easiest positive, the other view of the same image, so it pulls little
  on the rest of the class (Khosla et al., Sec. 3.2.2, found L_in the clearly weaker form on
  ImageNet). Fashion-MNIST, Dirichlet 0.1, 20 devices, C = 0.2, 15 rounds, seeds 0-2: 94.05 +- 0.68%
  with "in", 95.38 +- 0.75% with "out" (benchmarks/docs/papers.md). `--set variant=in` keeps the printed
  equation.
- BatchNorm running statistics are shared here (averaged like the weights), unlike in the other
  algorithms: the frozen body is released to weak devices (ONNX, no torch) that cannot recompute
  them, so the representation must carry its own normalization statistics.
- The head sees the body output r (as in Khosla et al.'s linear evaluation);
  `normalize_features=true` feeds z = r / ||r|| instead (slower to fit at the same lr).
- `recalibrate_bn` (default on): before extracting features a trainer device recomputes the
  BatchNorm statistics on its own training images with the frozen body (no weight changes), a
  local adaptation the next round's global statistics overwrite.
- `global_accuracy` is the probe itself: the deployed model is the global body with the
  personal head, and there is no global classifier, so it equals `accuracy`.
- `projection_dim` > 0 adds a shared projection MLP, Linear(d, d)-ReLU-Linear(d, p), used only
  by the stage-1 loss (Khosla et al.); heads always sit on the body. Default 0: none.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from ..augment import task_views
from ..data.task import TaskSpec
from ..lite.heads import CONSTANT_FEATURE_STD, fit_head
from ..losses import supcon_loss
from ..models import ModelSpec, build_body, seeded_init
from ..models.capabilities import COMMON, PROJECTOR
from ..training import LossFn, cross_entropy_loss, eval_mode, predict, recalibrate_batchnorm, run_epochs
from .base import FitResult, Task
from .hyper.repper import Hyper
from .torch_device import SHARED, TorchDevice

log = logging.getLogger(__name__)

FEATURE_BATCH = 512
"""Batch size for feature extraction (no gradients)."""


class RepPerNet(nn.Module):
    """The stage-1 network: `body` and `projector` (an identity unless configured); no classifier."""

    def __init__(self, body: nn.Module, feature_dim: int, projection_dim: int = 0) -> None:
        super().__init__()
        self.body = body
        self.feature_dim = feature_dim
        self.projector: nn.Module = (
            nn.Sequential(nn.Linear(feature_dim, feature_dim), nn.ReLU(inplace=True),
                          nn.Linear(feature_dim, projection_dim))
            if projection_dim
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The embedding the contrastive loss sees (normalized inside `supcon_loss`)."""
        return self.projector(self.body(x))


SHARED_PARTS = ("body", "projector")


def build_network(model: ModelSpec, task: TaskSpec, hyper: Hyper, seed: int) -> RepPerNet:
    """The same initial network on every device and on the server for the run's seed."""
    with seeded_init(seed):
        body, feature_dim = build_body(model, task)
        return RepPerNet(body, feature_dim, hyper.projection_dim)


Predictor = Callable[[torch.Tensor], torch.Tensor]
"""Features [N, d] -> predicted labels [N]."""


def _torch_head(kind: str, dim: int, classes: int, hidden: int) -> nn.Linear | nn.Sequential:
    if kind == "linear":
        return nn.Linear(dim, classes)
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, classes))


def sgd_head_optimizer(lr: float) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """The head's own optimizer: SGD at `lr`, momentum 0.9."""
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)


def fit_torch_head(kind: str, features: torch.Tensor, labels: torch.Tensor, classes: int, *, hidden: int,
                   epochs: int, batch_size: int, lr: float, seed: int,
                   optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None) -> nn.Module:
    """Eq. (6)/(9): a `linear` or `mlp` head trained with cross-entropy on frozen features.

    It learns on standardized features (each dimension's mean and standard deviation over the
    training split; constant dimensions, such as dead ReLU units, are zeroed), and the
    standardization is then folded into its first layer, so the returned head takes raw features,
    as the numpy heads do (`edge_sdk.lite.heads`). The body's raw features differ in scale by
    orders of magnitude (RepPer's is sparse), and SGD on them was ill-conditioned: on the final
    body of a Fashion-MNIST Dir 0.5 run the linear head scored 87.1% raw and 89.5% standardized,
    a logistic regression 89.7% (benchmarks/docs/accuracy.md); thirty raw epochs gave 87.8%.
    `optimizer` builds the head's optimizer from its parameters (default `sgd_head_optimizer(lr)`)."""
    mean = features.mean(0)
    scale = features.std(0)
    inverse_scale = torch.where(scale > CONSTANT_FEATURE_STD, scale, torch.inf).reciprocal()  # 0 where constant
    with seeded_init(seed):
        head = _torch_head(kind, features.shape[1], classes, hidden).to(features.device)
    head.train()
    make_optimizer = sgd_head_optimizer(lr) if optimizer is None else optimizer
    run_epochs(cross_entropy_loss(head), make_optimizer(list(head.parameters())),
               (features - mean) * inverse_scale, labels, epochs=epochs, batch_size=batch_size,
               generator=torch.Generator().manual_seed(seed))
    first = head if isinstance(head, nn.Linear) else cast(nn.Linear, head[0])  # the MLP's input layer
    with torch.no_grad():  # w' = w / sigma, b' = b - w' . mu: the head now takes raw features
        first.weight.mul_(inverse_scale)
        first.bias.sub_(first.weight @ mean)
    head.eval()
    return head


LITE_HEADS = {"svm": "svm", "lr": "lr", "mlp_sklearn": "mlp"}
"""RepPer's head kinds fitted by `edge_sdk.lite.heads`, and their names there."""


def fit_lite_head(kind: str, features: np.ndarray, labels: np.ndarray, num_classes: int, *, hidden: int, seed: int):
    """A weak device's numpy head (`edge_sdk.lite.heads.fit_head`) for RepPer's head `kind`, one
    of `LITE_HEADS`; it has `predict(features)`."""
    return fit_head(LITE_HEADS[kind], features, labels, num_classes=num_classes, seed=seed, hidden=hidden)


class RepPerDevice(TorchDevice):
    """Stage 1 in `fit` (contrastive body training), stage 2 in `evaluate` (personal head)."""

    id = "repper"
    display_name = "RepPer"
    citation = "RepPer"
    table_rank = 80
    paper_method = True
    requires = (*COMMON, PROJECTOR)
    dp_sgd_refusal = ("its supervised contrastive loss pairs every example with the others of its batch, so no "
                      "example has a gradient of its own to clip")
    Hyper = Hyper
    shared_parts = SHARED_PARTS
    share_statistics = True
    model: RepPerNet

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.head: Any = None  # the last evaluation's fitted personal head

    def build_network(self, base: nn.Module) -> RepPerNet:
        """The stage-1 network: the factory's body (built again, alone, so that a built-in body
        and the projector draw the same initial weights as ever) and the projector."""
        return build_network(self.model_spec, self.data.task, self.hyper, self.settings.seed)

    # -- stage 1: common representation learning -------------------------------------------
    def contrastive_loss(self, generator: torch.Generator) -> LossFn:
        """Eq. (4)-(5) on two augmented views of every sample of the batch."""
        task = self.data.task

        def loss(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            views = task_views(xb, task, generator)
            embeddings = self.model(views.flatten(0, 1)).view(len(yb), 2, -1)
            return supcon_loss(embeddings, yb, self.hyper.temperature, self.hyper.variant)

        return loss

    def fit(self, task: Task) -> FitResult:
        self.load_shared(task)
        self.model.train()
        generator = self.generator(task.round)
        optimizer = self.local_optimizer(self.model.parameters(), lambda own: torch.optim.Adam(
            own, lr=self.hyper.lr, weight_decay=self.hyper.weight_decay))
        loss = run_epochs(self.contrastive_loss(generator), optimizer, self.train_x, self.train_y,
                          epochs=self.settings.local_epochs, batch_size=self.settings.batch_size, generator=generator)
        return FitResult({SHARED: self.shared_state()}, {"num_examples": len(self.train_y), "loss": loss})

    # -- stage 2: personalized classification learning -------------------------------------
    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Frozen-body features of x: r = body(x), or z = r / ||r|| with `normalize_features`."""
        with eval_mode(self.model):
            r = predict(self.model.body, x, FEATURE_BATCH)
        return nn.functional.normalize(r, dim=1) if self.hyper.normalize_features else r

    def fit_head(self, features: torch.Tensor, seed: int) -> Predictor:
        """Fit the configured personal head on the training features; return its label predictor."""
        hyper = self.hyper
        if hyper.head in ("linear", "mlp"):
            head = fit_torch_head(hyper.head, features, self.train_y, self.data.task.num_classes,
                                  hidden=hyper.head_hidden, epochs=hyper.head_epochs,
                                  batch_size=self.settings.batch_size, lr=self.settings.lr, seed=seed,
                                  optimizer=lambda params: self.local_optimizer(params,
                                                                                sgd_head_optimizer(self.settings.lr)))
            self.head = head
            return lambda f: predict(head, f).argmax(dim=1)
        lite_head = fit_lite_head(hyper.head, features.cpu().numpy(), self.data.train_y, self.data.task.num_classes,
                                  hidden=hyper.head_hidden, seed=seed)
        self.head = lite_head
        return lambda f: torch.as_tensor(lite_head.predict(f.cpu().numpy()), device=f.device)

    def evaluate(self, task: Task) -> dict[str, float]:
        self.load_shared(task)
        if self.hyper.recalibrate_bn:
            recalibrate_batchnorm(self.model.body, self.train_x)
        predictor = self.fit_head(self.features(self.train_x), seed=self.client_seed * 100_003 + task.round)
        if len(self.test_y) == 0:
            acc = float("nan")
        else:
            acc = float((predictor(self.features(self.test_x)) == self.test_y).float().mean())
        log.debug("round %d: %s head, test accuracy %.4f", task.round, self.hyper.head, acc)
        return {"accuracy": acc, "num_test": len(self.test_y), "global_accuracy": acc}


DEVICE = RepPerDevice
