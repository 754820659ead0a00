"""FedRep (Collins et al., "Exploiting Shared Representations for Personalized Federated
Learning", ICML 2021).

Partition: `body` (the representation phi) shared, `head` (h_i) personal; BatchNorm running
statistics personal. Local update, Algorithm 1 of the paper: with the representation fixed,
`head_epochs` epochs of SGD on the head (the paper's tau_h steps, Eq. 2); then, with the new
head fixed, `body_epochs` epochs on the body (Eq. 3). Both phases minimize cross-entropy; each
phase has its own optimizer (the run's SGD settings) over its own parameters only.

Up: the body's parameters after the body phase; down: their example-weighted mean (Eq. 4).
Deployed model: the global body with the client's own head (no `global_accuracy`: there is no
global head).

Defaults: the paper uses 10 local epochs for the head and a few for the representation
(1 in its reference code). Here `head_epochs = 10` and `body_epochs` defaults to the run's
`local_epochs`, so `--local-epochs` means the same amount of shared-part training as in FedPer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .base import Task
from .part_sharing import PartSharingDevice


@dataclass(frozen=True)
class FedRepHyper:
    head_epochs: int = 10
    """Epochs on the personal head, body frozen, at the start of each local round."""
    body_epochs: int | None = None
    """Epochs on the shared body, head frozen, after the head phase (None: the run's local_epochs)."""


class FedRepDevice(PartSharingDevice):
    id = "fedrep"
    Hyper = FedRepHyper
    shared_parts = ("body",)

    def train_locally(self, task: Task) -> float:
        body_epochs = self.settings.local_epochs if self.hyper.body_epochs is None else self.hyper.body_epochs
        generator = self.generator(task.round)
        head_loss = self.train_parts(self.model, ("head",), self.hyper.head_epochs, generator)
        body_loss = self.train_parts(self.model, ("body",), body_epochs, generator)
        return head_loss if math.isnan(body_loss) else body_loss


DEVICE = FedRepDevice
