"""FedRoD (Chen and Chao, "On Bridging Generic and Personalized Federated Learning for Image
Classification", ICLR 2022), the version with a linear personal head (no hypernetwork).

Model: a shared body (features z), a shared generic head `head` and a personal linear head
`personal_head` on the same z. The generic prediction is head(z); the personalized one adds the
two heads' logits, head(z) + personal_head(z).

Local step, on every mini-batch, both losses at the values before the step:
- the body and the generic head descend the balanced softmax loss (balanced risk minimization),
  cross-entropy of the generic logits shifted by the log of the device's class prior,
  CE(head(z) + log(n_c / n), y), n_c the device's training examples of class c: the prior is
  taken out of the generic head, which thus learns class-balanced scores that every device agrees
  on whatever its label mix. A class the device lacks gets log 0 = -inf, probability 0 in its loss.
- the personal head descends plain cross-entropy of the personalized logits,
  CE(head(z).detach() + personal_head(z.detach()), y): nothing of it reaches the body or the
  generic head.
One optimizer steps all three parts (the FedAvg family's SGD at the run's lr, momentum 0.9) on the
sum of the two losses, whose gradient is exactly each part's own; the reported `loss` is that
sum, the mean of the last local epoch.

Partition, up and down: `body` and `head` shared (BatchNorm statistics stay on the device, as
in FedAvg); `personal_head` personal. Up: body and generic head after the local round; down:
their example-weighted mean. Deployed model: the global body with head(z) + personal_head(z)
(`accuracy`); the global body with the generic head alone is `global_accuracy` (the paper's
generic model). `personal_state` holds the personal head and the statistics.

Decisions where the paper leaves a choice:
- The personal head starts at zero, so before it has trained (a new device) the personalized
  prediction is the generic one, and it is scored as such: no new-client fitting is needed.
  Third-party implementations differ (a copy of the generic head, a random layer); the authors'
  code was not at hand.
- The personal head is an nn.Linear on the body's features whatever the factory's head is; the
  generic head is the factory's own.
- No trainer's own optimizer or loss (the balanced softmax is the algorithm's), and no DP-SGD
  (see `dp_sgd_refusal`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..models import PartedNet
from ..training import LossFn, accuracy, eval_mode
from .base import Task
from .part_sharing import PartSharingDevice


DP_SGD_REFUSAL = (
    "its balanced softmax adds the log of the device's label counts to every example's logits: "
    "the counts come from all of its records, so one record moves every example's gradient, "
    "which per-example clipping does not bound")
"""Why DP-SGD cannot train this algorithm (its `dp_sgd_refusal`)."""


class FedRodNet(PartedNet):
    """The factory's `body` and `head` (the generic head) and a `personal_head`, a zero linear
    layer on the features; `forward` is the personalized prediction."""

    def __init__(self, base: PartedNet, num_classes: int) -> None:
        assert base.feature_dim is not None  # build_model measured it
        super().__init__(base.body, base.head, base.feature_dim)
        self.personal_head = nn.Linear(base.feature_dim, num_classes)
        nn.init.zeros_(self.personal_head.weight)
        nn.init.zeros_(self.personal_head.bias)

    def generic(self, x: torch.Tensor) -> torch.Tensor:
        """The generic model's logits, head(z)."""
        return self.head(self.body(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The personalized logits, head(z) + personal_head(z)."""
        z = self.body(x)
        return self.head(z) + self.personal_head(z)


def log_prior(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """log(n_c / n) for every class c of `labels` (-inf for a class with no example)."""
    counts = torch.bincount(labels, minlength=num_classes).float()
    return (counts / counts.sum()).log()


class FedRodDevice(PartSharingDevice):
    id = "fedrod"
    display_name = "FedRoD"
    citation = "Chen and Chao 2022"
    table_rank = 170
    shared_parts = ("body", "head")
    accepts_training_step = False
    dp_sgd_refusal = DP_SGD_REFUSAL
    model: FedRodNet

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log_prior = log_prior(self.train_y, self.data.task.num_classes)

    def build_network(self, base: PartedNet) -> FedRodNet:
        """The factory's body and head with a zero personal head beside the head: no random draw,
        so body and head keep the initial weights the coordinator builds."""
        return FedRodNet(base, self.data.task.num_classes)

    def local_loss(self, task: Task) -> LossFn:
        """Balanced softmax of the generic logits + cross-entropy of the personalized logits, the
        latter on the detached features and generic logits."""
        model, prior = self.model, self.log_prior

        def loss(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            z = model.body(xb)
            generic = model.head(z)
            balanced = F.cross_entropy(generic + prior, yb)
            personal = F.cross_entropy(generic.detach() + model.personal_head(z.detach()), yb)
            return balanced + personal

        return loss

    def evaluate(self, task: Task) -> dict[str, float]:
        self.load_shared(task)
        with eval_mode(self.model):
            generic_accuracy = accuracy(self.model.generic, self.test_x, self.test_y)
        return {"accuracy": self.test_accuracy(self.model), "global_accuracy": generic_accuracy,
                "num_test": len(self.test_y)}


DEVICE = FedRodDevice
