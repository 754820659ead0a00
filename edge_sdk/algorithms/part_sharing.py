"""Shared machinery for algorithms that share some named parts of one model (FedAvg family).

The partition is by part name: the parts in `shared_parts` travel (their BatchNorm running
statistics excepted), everything else stays on the device. Subclasses change what is shared,
the local objective (`local_loss`) or the local schedule (`train_locally`).
"""

from __future__ import annotations

import copy
from typing import ClassVar

import torch

from ..models import build_model, statistics_keys
from ..params import Partition, check_arrays, part_of, partition_by_parts, spec_of
from ..protocol import ArrayGroup
from ..training import (
    LossFn,
    accuracy,
    cross_entropy_loss,
    eval_mode,
    load_arrays,
    pick_device,
    place,
    predict,
    recalibrate_batchnorm,
    run_epochs,
    state_arrays,
    to_device,
)
from .base import DeviceAlgorithm, FitResult, Task

SHARED = "shared"
"""The group name of the shared parameters, down (global) and up (local update)."""


def model_partition(model: torch.nn.Module, shared_parts: tuple[str, ...], share_statistics: bool = False) -> Partition:
    """Shared parts' keys are shared; BatchNorm running statistics only with `share_statistics`."""
    statistics = () if share_statistics else statistics_keys(model)
    return partition_by_parts(model.state_dict().keys(), shared_parts, statistics)


class PartSharingDevice(DeviceAlgorithm):
    """A model whose `shared_parts` are federated and whose other parts are personal."""

    shared_parts: ClassVar[tuple[str, ...]] = ("body", "head")
    share_statistics: ClassVar[bool] = False
    deploys_global_model: ClassVar[bool] = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.device = pick_device(self.device_name)
        self.model = place(self.build_network(), self.device)
        self.partition = model_partition(self.model, self.shared_parts, self.share_statistics)
        self.shared_spec = spec_of(state_arrays(self.model, self.partition.shared))
        self.train_x, self.train_y = to_device(self.data.train_x, self.device), to_device(self.data.train_y, self.device)
        self.test_x, self.test_y = to_device(self.data.test_x, self.device), to_device(self.data.test_y, self.device)

    def build_network(self) -> torch.nn.Module:
        """The device's network, identical on every device for the run's seed; its top-level
        children are the parts that `shared_parts` names."""
        meta = self.data.meta
        return build_model(self.settings.model, in_channels=meta.channels, num_classes=meta.num_classes,
                           image_size=meta.image_size, seed=self.settings.seed)

    # -- what travels ----------------------------------------------------------------------
    def load_shared(self, task: Task) -> None:
        if SHARED in task.groups:
            check_arrays(SHARED, task.groups[SHARED], self.shared_spec)
            load_arrays(self.model, task.groups[SHARED])

    def shared_state(self) -> ArrayGroup:
        return state_arrays(self.model, self.partition.shared)

    def body_statistics(self, task: Task) -> ArrayGroup:
        """The global body's BatchNorm statistics on this device's training split (`body.*`
        keys), recomputed on a copy so that the device's own statistics stay as they are."""
        if "body" not in self.shared_parts:
            return {}
        self.load_shared(task)
        body = copy.deepcopy(self.model.body)
        recalibrate_batchnorm(body, self.train_x)
        return {f"body.{key}": value for key, value in state_arrays(body, sorted(statistics_keys(body))).items()}

    def personal_state(self) -> ArrayGroup:
        return state_arrays(self.model, self.partition.personal)

    def load_personal_state(self, arrays: ArrayGroup) -> None:
        check_arrays("personal", arrays, spec_of(self.personal_state()))
        load_arrays(self.model, arrays)

    # -- local work ------------------------------------------------------------------------
    def generator(self, round_: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.client_seed * 100_003 + round_)

    def optimizer(self, params=None, *, lr: float | None = None, momentum: float = 0.9) -> torch.optim.Optimizer:
        """SGD over `params` (default: the whole model) at `lr` (default: the run's); subclasses with
        their own lr or momentum hyperparameters pass them here."""
        params = self.model.parameters() if params is None else params
        return torch.optim.SGD(params, lr=self.settings.lr if lr is None else lr, momentum=momentum)

    def local_loss(self, task: Task) -> LossFn:
        return cross_entropy_loss(self.model)

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
        )

    def train_parts(self, model: torch.nn.Module, parts: tuple[str, ...], epochs: int,
                    generator: torch.Generator) -> float:
        """Minimize CE over the parameters of `parts` of `model` for `epochs`, the other parts frozen
        (no gradients, not in the optimizer; their BatchNorm statistics still follow the batches).
        Returns the mean loss of the last epoch (NaN for zero epochs)."""
        frozen = [p for name, p in model.named_parameters() if part_of(name) not in parts and p.requires_grad]
        trained = [p for name, p in model.named_parameters() if part_of(name) in parts]
        for param in frozen:
            param.requires_grad_(False)
        try:
            model.train()
            return run_epochs(cross_entropy_loss(model), self.optimizer(trained), self.train_x, self.train_y,
                              epochs=epochs, batch_size=self.settings.batch_size, generator=generator)
        finally:
            for param in frozen:
                param.requires_grad_(True)

    def train_head_on_features(self, model: torch.nn.Module, epochs: int, generator: torch.Generator) -> float:
        """Minimize CE over `model.head` for `epochs` on the features of the frozen `model.body`, the
        features the deployed model computes: the body's BatchNorm statistics are recomputed on the
        device's training split (they are personal, and the shared weights just changed), its
        features extracted once in evaluation mode, and the head trained on them. Ten head epochs
        thus cost one forward pass of the body, not ten, and the head learns on the same features
        it is scored on (in training mode it would see each batch's own statistics). Returns the
        mean loss of the last epoch (NaN for zero epochs)."""
        if epochs == 0:
            return float("nan")
        recalibrate_batchnorm(model.body, self.train_x)
        with eval_mode(model.body):
            features = predict(model.body, self.train_x)
        model.head.train()
        return run_epochs(cross_entropy_loss(model.head), self.optimizer(model.head.parameters()), features,
                          self.train_y, epochs=epochs, batch_size=self.settings.batch_size, generator=generator)

    def fit(self, task: Task) -> FitResult:
        self.load_shared(task)
        loss = self.train_locally(task)
        return FitResult({SHARED: self.shared_state()}, {"num_examples": len(self.train_y), "loss": loss})

    def test_accuracy(self, model: torch.nn.Module) -> float:
        """Accuracy of `model` (in evaluation mode) on the device's test split."""
        with eval_mode(model):
            return accuracy(model, self.test_x, self.test_y)

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

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trained = False

    def new_client_head_epochs(self) -> int:
        """Head epochs of a new client: 10, FedRep's tau_h default (FedRep uses its `head_epochs`)."""
        return 10

    def fit(self, task: Task) -> FitResult:
        result = super().fit(task)
        self.trained = True
        return result

    def evaluate(self, task: Task) -> dict[str, float]:
        self.load_shared(task)
        if not self.trained:
            self.train_head_on_features(self.model, self.new_client_head_epochs(), self.generator(task.round))
        return self.score()
