"""Ditto (Li et al., "Ditto: Fair and Robust Federated Learning Through Personalization", ICML 2021).

Two models on every device: the global model w, federated exactly as FedAvg, and a personal model
v that never leaves the device. Algorithm 1 of the paper, per round on a selected device k that
received w^t: the global update runs the FedAvg local solver on F_k(w) from w^t (the run's
`local_epochs` of SGD on cross-entropy); the personal update runs `personal_epochs` epochs of SGD
on the personal objective (Eq. 2)

    h_k(v; w^t) = F_k(v) + lambda/2 * ||v - w^t||^2,

whose gradient is grad F_k(v) + lambda * (v - w^t), anchored at the w^t that came down (not at
the device's updated w). The proximal term runs over every parameter (the whole model is
shared); BatchNorm running statistics are buffers: the global model's stay on the device, as in
FedAvg here, and the personal model has its own.

Partition, up and down: as FedAvg. Up: all parameters of w after its update; down: their
example-weighted mean. Deployed model: v (`accuracy`); w^t with the device's statistics is
scored as `global_accuracy`. `personal_state` holds v (keys prefixed `personal_model.`) with the
global model's statistics, so a restarted device resumes its personal model.

Decisions where the paper leaves a choice:
- v starts as the factory's model (the same initial weights as w^0, from the run's seed). A device
  that has not trained since it started (a new client, or one not selected yet) is scored after
  one personal update from w^t: v is set to w^t and trained on h_k, since scoring the untouched
  initialization would measure nothing of the federation. A restarted device with a saved v
  uses it as it is.
- lambda defaults to 1, inside the grid the paper tunes over ({0.05, 0.1, 0.2, 0.5, 1, 2}); it is
  a `[algorithm.ditto] lam` setting. The optimizer of both updates is the FedAvg family's (SGD
  at the run's lr, momentum 0.9), where the paper's analysis assumes plain gradient steps.
- Under DP-SGD the personal update's steps are DP-SGD steps too and are counted by the device's
  accountant: more than the uploads need (v never leaves), never less.
"""

from __future__ import annotations

import copy

import torch

from ..params import check_arrays, spec_of
from ..privacy.dpsgd import PenalizedLoss
from ..protocol import ArrayGroup
from ..training import LossFn, load_arrays, run_epochs, state_arrays
from .base import FitResult, Task
from .hyper.ditto import Hyper as DittoHyper
from .part_sharing import SHARED, PartSharingDevice

PERSONAL_MODEL = "personal_model."
"""Prefix of the personal model's entries in the device's personal state."""


class DittoDevice(PartSharingDevice):
    id = "ditto"
    display_name = "Ditto"
    citation = "Li et al. 2021b"
    table_rank = 130
    Hyper = DittoHyper
    shared_parts = ("body", "head")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.personal = copy.deepcopy(self.model)
        """v: the personal model, the deployed one."""

    def personal_loss(self, anchor: list[torch.Tensor]) -> LossFn:
        """h_k(v; w^t) = F_k(v) + lambda/2 * ||v - w^t||^2 over every parameter of v, `anchor` being
        w^t's parameters in the order of `self.personal.parameters()`."""
        params = list(self.personal.parameters())
        lam = self.hyper.lam

        def proximal() -> torch.Tensor:
            return 0.5 * lam * sum(((p - a) ** 2).sum() for p, a in zip(params, anchor, strict=True))

        return PenalizedLoss(self.objective(self.personal), proximal)

    def update_personal(self, anchor: list[torch.Tensor], round_: int) -> float:
        """`personal_epochs` epochs (default: the run's `local_epochs`) of SGD on h_k(v; w^t)."""
        epochs = self.settings.local_epochs if self.hyper.personal_epochs is None else self.hyper.personal_epochs
        self.personal.train()
        return run_epochs(self.personal_loss(anchor), self.optimizer(self.personal.parameters()), self.train_x,
                          self.train_y, epochs=epochs, batch_size=self.settings.batch_size,
                          generator=self.generator(round_), module=self.personal)

    def received_global(self) -> list[torch.Tensor]:
        """w^t's parameters, as loaded into the global model (before it trains)."""
        return [p.detach().clone() for p in self.model.parameters()]

    def fit(self, task: Task) -> FitResult:
        self.load_shared(task)
        anchor = self.received_global()
        loss = self.train_locally(task)
        personal_loss = self.update_personal(anchor, task.round)
        self.trained = True
        return FitResult({SHARED: self.shared_state()},
                         {"num_examples": len(self.train_y), "loss": loss, "personal_loss": personal_loss})

    def evaluate(self, task: Task) -> dict[str, float]:
        self.load_shared(task)
        global_accuracy = self.test_accuracy(self.model)
        if not self.trained:
            self.personal.load_state_dict(self.model.state_dict())
            self.update_personal(self.received_global(), task.round)
        return {"accuracy": self.test_accuracy(self.personal), "global_accuracy": global_accuracy,
                "num_test": len(self.test_y)}

    # -- what stays ------------------------------------------------------------------------
    def personal_state(self) -> ArrayGroup:
        own = state_arrays(self.personal, list(self.personal.state_dict()))
        return {**super().personal_state(), **{PERSONAL_MODEL + key: value for key, value in own.items()}}

    def load_personal_state(self, arrays: ArrayGroup) -> None:
        check_arrays("personal", arrays, spec_of(self.personal_state()))
        load_arrays(self.model, {k: v for k, v in arrays.items() if not k.startswith(PERSONAL_MODEL)})
        load_arrays(self.personal, {k.removeprefix(PERSONAL_MODEL): v for k, v in arrays.items()
                                    if k.startswith(PERSONAL_MODEL)})
        self.trained = True


DEVICE = DittoDevice
