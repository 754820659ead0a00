"""FedProto: federated prototype learning (Tan et al., AAAI 2022), the device side.

Parts and partition: nothing is shared. The whole model (body f, head, BatchNorm statistics) is
personal, and its architecture may differ between devices (`Hyper.body_models`, as DC-PFL's;
the feature dimension d must agree). Only class prototypes travel.

Down each round: group `global_prototypes`, the global prototypes C_bar^(j) (`prototypes` [C, d]
float32) with a mask `has_prototype` [C] bool (all False in the first round, when none exist yet).

Local work (Algorithm 1, LocalUpdate): train body and head for E epochs on Eq. (7),
CE(head(f(x)), y) + lam * L_R, with L_R (Eq. 8, "a distance metric", L2 in the paper) the
official code's MSE between each example's features and its class's global prototype,
(1 / (B d)) sum_i ||f(x_i) - C_bar^(y_i)||^2 over the batch; an example whose class has no global
prototype adds zero (and still counts in B), so in the first round the term is absent. Then,
with the trained body in evaluation mode and without gradients, the local prototypes C_i^(j)
(Eq. 3): the mean of f(x) over the device's training examples of class j (as PFLlib's
`collect_protos`; the official code averages the features seen while training instead).

Up: group `prototypes`, the terms of the server's count-weighted mean (Eq. 6) divided by the
device's N_i training examples, all float32: `class_shares` [C] = |D_i,j| / N_i and
`feature_sums` [C, d] = |D_i,j| / N_i * C_i^(j) (zero for a class the device lacks). The
coordinator weighs an update by N_i, so the weighted sums over devices are sum_i |D_i,j| and
sum_i |D_i,j| C_i^(j) over a common factor, and their ratio is Eq. (6): a sum of per-update
terms, which shard aggregators and secure aggregation add up as they add FedAvg's.
(`local_prototypes` recovers counts and prototypes from an upload.) No model parameter goes up.

Deployed model (`accuracy`): the device's own model, body and head. Also reported,
`prototype_accuracy`: the paper's inference (Eq. 4), the nearest global prototype to f(x) in
Euclidean distance over the classes that have one (absent while none has).

Decision (local optimizer): SGD with the run's `--lr` and momentum 0.9, the local optimizer of
the other personal methods here.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from ..models import ModelSpec, PartedNet, describe
from ..models.capabilities import COMMON
from ..params import ArraySpec
from ..protocol import ArrayGroup
from ..training import LossFn, eval_mode, predict, run_epochs
from .base import FitResult, Task
from .hyper.fedproto import Hyper
from .torch_device import TorchDevice

log = logging.getLogger(__name__)

GLOBAL_PROTOTYPES = "global_prototypes"
"""Down: the global prototypes `prototypes` [C, d] and the mask `has_prototype` [C]."""
PROTOTYPES = "prototypes"
"""Up: `class_shares` [C] and `feature_sums` [C, d], the device's terms of Eq. (6)."""


# -- prototypes (pure numpy; the coordinator uses the same functions) ----------------------------
def prototypes_spec(num_classes: int, dim: int) -> ArraySpec:
    """Names, shapes and dtypes of the `prototypes` upload."""
    return {"class_shares": ((num_classes,), "float32"), "feature_sums": ((num_classes, dim), "float32")}


def global_prototypes_spec(num_classes: int, dim: int) -> ArraySpec:
    """Names, shapes and dtypes of the `global_prototypes` group that comes down."""
    return {"prototypes": ((num_classes, dim), "float32"), "has_prototype": ((num_classes,), "bool")}


def prototype_terms(features: np.ndarray, labels: np.ndarray, num_classes: int) -> ArrayGroup:
    """The `prototypes` upload of a device's training features [N, d] and labels [N]: class shares
    |D_j| / N and feature sums |D_j| / N * C^(j) = (1 / N) sum_{y = j} f(x), computed in float64."""
    features = np.asarray(features, dtype=np.float64)
    total = max(len(labels), 1)
    sums = np.zeros((num_classes, features.shape[1]))
    np.add.at(sums, labels, features)
    shares = np.bincount(labels, minlength=num_classes) / total
    return {"class_shares": shares.astype(np.float32), "feature_sums": (sums / total).astype(np.float32)}


def local_prototypes(upload: ArrayGroup, num_examples: int) -> tuple[np.ndarray, np.ndarray]:
    """The class counts [C] int64 and local prototypes C^(j) [C, d] float64 (zero for an absent
    class) that a device with `num_examples` training examples uploaded."""
    shares = np.asarray(upload["class_shares"], dtype=np.float64)
    sums = np.asarray(upload["feature_sums"], dtype=np.float64)
    counts = np.rint(shares * num_examples).astype(np.int64)
    means = np.divide(sums, shares[:, None], out=np.zeros_like(sums), where=shares[:, None] > 0)
    return counts, means


# -- the device -----------------------------------------------------------------------------
class FedProtoDevice(TorchDevice):
    """A personal model trained with the prototype term; uploads its class prototypes only."""

    id = "fedproto"
    display_name = "FedProto"
    citation = "Tan et al. 2022"
    table_rank = 180
    Hyper = Hyper
    requires = COMMON
    dp_sgd_refusal = ("its upload is per-class feature means (prototypes) computed directly from the training "
                      "records, not by the DP-SGD steps, so DP-SGD would protect none of it")
    model: PartedNet  # the factory's network: `build_network` is not overridden
    shared_parts = ()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        dim, classes = self.model.feature_dim, self.data.task.num_classes
        assert dim is not None  # build_model measured it
        self.global_spec = global_prototypes_spec(classes, dim)
        log.debug("fedproto device with model %s (d=%d)", describe(self.network_spec()), dim)

    def network_spec(self) -> ModelSpec:
        """The model the coordinator assigned this device (`body_models`), else the run's model."""
        return self.assignment.get("model", self.model_spec)

    # -- what travels ----------------------------------------------------------------------
    def global_prototypes(self, task: Task) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(prototypes [C, d], has_prototype [C]) on the device, or None when no class has one yet."""
        return self.class_values(task, GLOBAL_PROTOTYPES, self.global_spec)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """f(x) of the body in evaluation mode, without gradients."""
        with torch.no_grad(), eval_mode(self.model):
            return predict(self.model.body, x)

    # -- local work ------------------------------------------------------------------------
    def local_loss(self, prototypes: tuple[torch.Tensor, torch.Tensor] | None) -> LossFn:
        """Eq. (7): CE + lam * MSE(f(x), C_bar^(y)), the second term zero for classes without a prototype."""
        criterion = nn.CrossEntropyLoss()

        def loss(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            z = self.model.body(xb)
            value = criterion(self.model.head(z), yb)
            if prototypes is not None and self.hyper.lam > 0:
                centres, has_prototype = prototypes
                squared = ((z - centres[yb]) ** 2).sum(dim=1) * has_prototype[yb]
                value = value + self.hyper.lam * squared.sum() / z.numel()
            return value

        return loss

    def train_locally(self, task: Task) -> float:
        self.model.train()
        return run_epochs(
            self.local_loss(self.global_prototypes(task)),
            self.local_optimizer(self.model.parameters(),
                                 lambda own: torch.optim.SGD(own, lr=self.settings.lr, momentum=0.9)),
            self.train_x,
            self.train_y,
            epochs=self.settings.local_epochs,
            batch_size=self.settings.batch_size,
            generator=self.generator(task.round),
            module=self.model,
        )

    def fit(self, task: Task) -> FitResult:
        loss = self.train_locally(task)
        features = self.features(self.train_x).double().cpu().numpy()
        upload = prototype_terms(features, self.data.train_y, self.data.task.num_classes)
        return FitResult({PROTOTYPES: upload}, {"num_examples": len(self.train_y), "loss": loss})

    # -- scoring ---------------------------------------------------------------------------
    def evaluate(self, task: Task) -> dict[str, float]:
        metrics = {"accuracy": self.test_accuracy(self.model), "num_test": len(self.test_y)}
        prototypes = self.global_prototypes(task)
        if prototypes is not None and len(self.test_y):
            metrics["prototype_accuracy"] = self.prototype_accuracy(*prototypes)
        return metrics

    def prototype_accuracy(self, prototypes: torch.Tensor, has_prototype: torch.Tensor) -> float:
        """The paper's inference on the test split: the class of the nearest global prototype."""
        distances = torch.cdist(self.features(self.test_x), prototypes)
        distances[:, ~has_prototype] = float("inf")
        return float((distances.argmin(dim=1) == self.test_y).float().mean())


DEVICE = FedProtoDevice
