"""FedRep (Collins et al., "Exploiting Shared Representations for Personalized Federated
Learning", ICML 2021).

Partition: `body` (the representation phi) shared, `head` (h_i) personal; BatchNorm running
statistics personal. Local update, Algorithm 1 of the paper: with the representation fixed,
`head_epochs` epochs of SGD on the head (the paper's tau_h steps, Eq. 2); then, with the new
head fixed, `body_epochs` epochs on the body (Eq. 3). Both phases minimize cross-entropy; each
phase has its own optimizer over its own parameters only. The head phase learns on the frozen
body's features as the deployed model computes them (BatchNorm statistics recomputed on the
device's data, evaluation mode), extracted once: `PartSharingDevice.train_head_on_features`.

Up: the body's parameters after the body phase; down: their example-weighted mean (Eq. 4).
Deployed model: the global body with the client's own head (no `global_accuracy`: there is no
global head). A device that has not trained yet (a new client) runs the head phase alone,
`head_epochs` on the frozen global body, before it is scored (`PersonalHeadDevice`), as the
paper's new clients learn only their heads.

Defaults: the paper uses 10 local epochs for the head and a few for the representation
(1 in its reference code). Here `head_epochs = 10` and `body_epochs` defaults to the run's
`local_epochs`, so `--local-epochs` means the same amount of shared-part training as in FedPer.
The optimizer is SGD with the run's lr (`lr` overrides it) and momentum 0.5, the reference
code's momentum (its lr is 0.01), not the 0.9 of the rest of the FedAvg family. Measured on
Fashion-MNIST, Dirichlet 0.1, 20 devices, lr 0.05 (benchmarks/docs/accuracy.md): with momentum 0.9 the
body trained under a frozen, confident personal head was unstable. On seed 1 the last BatchNorm
shifted every channel negative (all ReLUs dead, constant features, each device predicting its
majority class: 67.4% from round 4 on), and seed 2 fell from 90.0% to 44.6% at round 9 before
recovering. With momentum 0.5: 96.58, 94.93 and 96.79 at round 15 on seeds 0, 1 and 2.
"""

from __future__ import annotations

import math

import torch

from .base import Task
from .hyper.fedrep import Hyper as FedRepHyper
from .part_sharing import PersonalHeadDevice


class FedRepDevice(PersonalHeadDevice):
    id = "fedrep"
    display_name = "FedRep"
    citation = "Collins et al. 2021"
    table_rank = 60
    Hyper = FedRepHyper

    def optimizer(self, params=None, *, lr: float | None = None,
                  momentum: float | None = None) -> torch.optim.Optimizer:
        """SGD at FedRep's own lr and momentum (unless given)."""
        return super().optimizer(params, lr=self.hyper.lr if lr is None else lr,
                                 momentum=self.hyper.momentum if momentum is None else momentum)

    def new_client_head_epochs(self) -> int:
        return self.hyper.head_epochs

    def train_locally(self, task: Task) -> float:
        body_epochs = self.settings.local_epochs if self.hyper.body_epochs is None else self.hyper.body_epochs
        generator = self.generator(task.round)
        head_loss = self.train_head_on_features(self.model, self.hyper.head_epochs, generator)
        body_loss = self.train_parts(self.model, ("body",), body_epochs, generator)
        return head_loss if math.isnan(body_loss) else body_loss


DEVICE = FedRepDevice
