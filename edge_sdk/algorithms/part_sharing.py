"""The FedAvg family's behaviour: train the model on cross-entropy, send up the shared parts.

The partition is by part name (`TorchDevice`): the parts in `shared_parts` travel (their
BatchNorm running statistics excepted), everything else stays on the device. Subclasses change
what is shared, the local objective (`local_loss`) or the local schedule (`train_locally`).
A trainer may bring its own optimizer and loss (`accepts_training_step`): they replace SGD and
cross-entropy everywhere here, and an algorithm's own terms (FedProx's proximal term) are added
to the user's loss.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..models import PartedNet
from ..params import part_of
from ..training import LossFn, cross_entropy_loss, eval_mode, predict, recalibrate_batchnorm, run_epochs
from .base import FitResult, Task
from .torch_device import SHARED, TorchDevice, model_partition

__all__ = ["SHARED", "PartSharingDevice", "PersonalHeadDevice", "model_partition"]


class PartSharingDevice(TorchDevice):
    """A model whose `shared_parts` are federated and whose other parts are personal."""

    accepts_training_step = True
    dp_sgd_refusal: ClassVar[str | None] = None
    """None: cross-entropy is a mean of per-example terms (FedProx adds a parameter-only term)."""
    deploys_global_model: ClassVar[bool] = False
    model: PartedNet  # the factory's network: `build_network` is not overridden

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trained = False
        """Whether this device has trained since it started: one that has not (a new client, or a
        restarted one) is scored after whatever its algorithm does for new clients."""

    # -- the training step -----------------------------------------------------------------
    def optimizer(self, params=None, *, lr: float | None = None, momentum: float = 0.9) -> torch.optim.Optimizer:
        """SGD over `params` (default: the whole model) at `lr` (default: the run's); subclasses with
        their own lr or momentum hyperparameters pass them here. A trainer's own optimizer
        factory, when given, replaces it; the run's common optimizer (`local_optimizer`) replaces
        SGD with these lr and momentum."""
        params = self.model.parameters() if params is None else params
        if self.user_optimizer is not None:
            return self.user_optimizer(list(params), self.settings)
        return self.local_optimizer(params, lambda own: torch.optim.SGD(
            own, lr=self.settings.lr if lr is None else lr, momentum=momentum))

    def objective(self, module: torch.nn.Module) -> LossFn:
        """The loss of `module`'s outputs: cross-entropy, or the trainer's own loss when given."""
        if self.user_loss is None:
            return cross_entropy_loss(module)
        user_loss = self.user_loss
        return lambda xb, yb: user_loss(module(xb), yb)

    def local_loss(self, task: Task) -> LossFn:
        return self.objective(self.model)

    def train_locally(self, task: Task) -> float:
        self.model.train()
        return run_epochs(
            self.local_loss(task),
            self.optimizer(),
            self.train_x,
            self.train_y,
            epochs=self.settings.local_epochs,
            batch_size=self.settings.batch_size,
            generator=self.generator(task.round),
            module=self.model,
        )

    def train_parts(self, model: torch.nn.Module, parts: tuple[str, ...], epochs: int,
                    generator: torch.Generator) -> float:
        """Minimize the objective over the parameters of `parts` of `model` for `epochs`, the other
        parts frozen (no gradients, not in the optimizer; their BatchNorm statistics still follow
        the batches). Returns the mean loss of the last epoch (NaN for zero epochs)."""
        frozen = [p for name, p in model.named_parameters() if part_of(name) not in parts and p.requires_grad]
        trained = [p for name, p in model.named_parameters() if part_of(name) in parts]
        for param in frozen:
            param.requires_grad_(False)
        try:
            model.train()
            return run_epochs(self.objective(model), self.optimizer(trained), self.train_x, self.train_y,
                              epochs=epochs, batch_size=self.settings.batch_size, generator=generator, module=model)
        finally:
            for param in frozen:
                param.requires_grad_(True)

    def train_head_on_features(self, model: PartedNet, epochs: int, generator: torch.Generator) -> float:
        """Minimize the objective over `model.head` for `epochs` on the features of the frozen
        `model.body`, the features the deployed model computes: the body's BatchNorm statistics
        are recomputed on the device's training split (they are personal, and the shared weights
        just changed), its features extracted once in evaluation mode, and the head trained on
        them. Ten head epochs thus cost one forward pass of the body, not ten, and the head
        learns on the same features it is scored on (in training mode it would see each batch's
        own statistics). Returns the mean loss of the last epoch (NaN for zero epochs)."""
        if epochs == 0:
            return float("nan")
        recalibrate_batchnorm(model.body, self.train_x)
        with eval_mode(model.body):
            features = predict(model.body, self.train_x)
        model.head.train()
        return run_epochs(self.objective(model.head), self.optimizer(model.head.parameters()), features,
                          self.train_y, epochs=epochs, batch_size=self.settings.batch_size, generator=generator,
                          module=model.head)

    # -- a round ---------------------------------------------------------------------------
    def fit(self, task: Task) -> FitResult:
        self.load_shared(task)
        loss = self.train_locally(task)
        self.trained = True
        return FitResult({SHARED: self.shared_state()}, {"num_examples": len(self.train_y), "loss": loss})

    def evaluate(self, task: Task) -> dict[str, float]:
        self.load_shared(task)
        return self.score()

    def score(self) -> dict[str, float]:
        """The deployed model's metrics on the device's test split."""
        acc = self.test_accuracy(self.model)
        metrics = {"accuracy": acc, "num_test": len(self.test_y)}
        if self.deploys_global_model:
            metrics["global_accuracy"] = acc
        return metrics


class PersonalHeadDevice(PartSharingDevice):
    """A shared body with a personal head (FedPer, FedRep). A device that has not trained since
    it started, a new client (held out of training, or not yet selected under partial
    participation), first fits its head on the frozen global body and is then scored, as FedRep's
    paper evaluates new clients: its head is still the random initialization, so scoring it as it
    is would measure that initialization, not the shared representation. A device restarted from
    its saved state does the same until it trains again, which adapts the saved head to the
    current body."""

    shared_parts = ("body",)

    def new_client_head_epochs(self) -> int:
        """Head epochs of a new client: 10, FedRep's tau_h default (FedRep uses its `head_epochs`)."""
        return 10

    def evaluate(self, task: Task) -> dict[str, float]:
        self.load_shared(task)
        if not self.trained:
            self.train_head_on_features(self.model, self.new_client_head_epochs(), self.generator(task.round))
        return self.score()
