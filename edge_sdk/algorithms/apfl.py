"""APFL (Deng, Kamani and Mahdavi, "Adaptive Personalized Federated Learning", 2020).

Three things on every device: the global model w, federated exactly as FedAvg; a local model v;
and a mixing weight alpha in [0, 1]. The personalized model is the parameter mixture

    v_bar = alpha * v + (1 - alpha) * w.

Algorithm 1 of the paper, per local step on a selected device k with mini-batch xi, all three
gradients taken at the values before the step:

    w     <- w - lr * grad F_k(w; xi)                      (FedAvg's local solver)
    v     <- v - lr * grad_v F_k(v_bar; xi) = v - lr * alpha * grad F_k(v_bar; xi)
    alpha <- alpha - lr_alpha * <v - w, grad F_k(v_bar; xi)>   (the adaptive alpha, Eq. 10 of the arXiv version)

with alpha then projected onto [0, 1]. The mixture takes the device's current local w (as the
paper's v_bar^(t-1) = alpha v^(t-1) + (1 - alpha) w^(t-1)), and no gradient of F_k(v_bar) reaches
w. One optimizer steps all three: the local loss is F_k(w) + F_k(v_bar) with w detached inside
v_bar, whose gradient is exactly the three above; alpha is a parameter group of its own (plain
steps at `alpha_lr`, no momentum, no weight decay) clipped to [0, 1] after every step. The
reported `loss` is that sum, the mean of the last local epoch.

BatchNorm: v_bar runs v's network with the mixed parameters (`MixedNet`) and v's running
statistics, which therefore describe v_bar's features; w keeps its own statistics on the device,
as in FedAvg.

Partition, up and down: as FedAvg. Up: all parameters of w after the local round; down: their
example-weighted mean. Deployed model: v_bar with the w^t that came down (`accuracy`); w^t with
the device's statistics is scored as `global_accuracy`. `personal_state` holds v (keys prefixed
`personal_model.`) and alpha (`mixing_weight`) besides w's statistics: neither is ever uploaded
(alpha is no metric either), and a restarted device resumes both.

Defaults: alpha starts at 0.25, adapts (`adaptive`), and steps at the run's lr (`alpha_lr`
none), as the paper steps alpha with the models' learning rate. The models' optimizer is the
FedAvg family's (SGD at the run's lr, momentum 0.9), where the paper analyses plain steps.

Decisions where the paper leaves a choice:
- v starts at the global model: a device that has not trained since it started (a new client, one
  not selected yet, or the first round) sets v to the w^t that came down and alpha to `alpha`
  before it trains or is scored, so an untrained device deploys w^t itself. A restarted device
  with saved state uses its v and alpha as they are.
- Initial alpha 0.25, one of the fixed alphas (0.25, 0.5, 0.75) the paper's experiments set
  beside the adaptive one (recalled, not checked against the paper's text); the adaptive update
  moves alpha from wherever it starts (its gradient is zero while v = w).
- alpha steps after every local step, by the paper's update. The authors' code (FedTorch)
  steps it once per round, on the round's first batch, with 0.02 * alpha added to its gradient;
  neither is followed here.
- No trainer's own optimizer or loss: alpha's step is part of the algorithm. No DP-SGD (see
  `dp_sgd_refusal`).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from ..params import check_arrays, spec_of
from ..protocol import ArrayGroup
from ..training import LossFn, load_arrays, run_epochs, state_arrays
from .base import Task
from .hyper.apfl import Hyper as ApflHyper
from .part_sharing import PartSharingDevice

PERSONAL_MODEL = "personal_model."
"""Prefix of the local model v's entries in the device's personal state."""
MIXING_WEIGHT = "mixing_weight"
"""The personal-state entry of alpha (a float32 scalar)."""


DP_SGD_REFUSAL = (
    "its personalized model runs the mixed parameters alpha*v + (1-alpha)*w through a functional "
    "call, where per-example gradient hooks see no parameter, and its mixing weight alpha steps on "
    "the whole batch's gradient")
"""Why DP-SGD cannot train this algorithm (its `dp_sgd_refusal`)."""


class MixedNet(nn.Module):
    """v_bar = alpha * v + (1 - alpha) * w: `personal`'s network (v) run with the mixed parameters
    and `personal`'s own buffers. `global_model` (w) enters detached: no gradient of v_bar's loss
    reaches it, while v and `alpha` get theirs."""

    def __init__(self, personal: nn.Module, global_model: nn.Module, alpha: float) -> None:
        super().__init__()
        self.personal = personal
        self.global_model = global_model
        device = next(personal.parameters()).device
        self.alpha = nn.Parameter(torch.tensor(alpha, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = dict(self.global_model.named_parameters())
        alpha = self.alpha
        mixed = {name: alpha * v + (1 - alpha) * w[name].detach() for name, v in self.personal.named_parameters()}
        return functional_call(self.personal, mixed, (x,))


class ApflDevice(PartSharingDevice):
    id = "apfl"
    display_name = "APFL"
    citation = "Deng et al. 2020"
    table_rank = 160
    Hyper = ApflHyper
    shared_parts = ("body", "head")
    accepts_training_step = False
    dp_sgd_refusal = DP_SGD_REFUSAL

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mixed = MixedNet(copy.deepcopy(self.model), self.model, self.hyper.alpha)
        """v_bar; `self.mixed.personal` is v, `self.mixed.alpha` is alpha."""
        self.mixed.alpha.requires_grad_(self.hyper.adaptive)

    @property
    def personal(self) -> nn.Module:
        """v, the local model."""
        return self.mixed.personal

    def start_personal(self) -> None:
        """v := the global model as it is now (its statistics too), alpha := its initial value."""
        self.personal.load_state_dict(self.model.state_dict())
        with torch.no_grad():
            self.mixed.alpha.fill_(self.hyper.alpha)

    # -- a round ---------------------------------------------------------------------------
    def local_loss(self, task: Task) -> LossFn:
        """F_k(w) + F_k(v_bar): w gets grad F_k(w), v alpha * grad F_k(v_bar) and alpha
        <v - w, grad F_k(v_bar)> (w is detached inside v_bar)."""
        global_loss, personal_loss = self.objective(self.model), self.objective(self.mixed)
        return lambda xb, yb: global_loss(xb, yb) + personal_loss(xb, yb)

    def local_optimizer_of_round(self) -> torch.optim.Optimizer:
        """The models' optimizer over w and v, plus, when alpha adapts, alpha's own group: plain
        steps at `alpha_lr`, then the projection onto [0, 1]."""
        optimizer = self.optimizer([*self.model.parameters(), *self.personal.parameters()])
        if self.hyper.adaptive:
            alpha = self.mixed.alpha
            lr = self.settings.lr if self.hyper.alpha_lr is None else self.hyper.alpha_lr
            optimizer.add_param_group({"params": [alpha], "lr": lr, "momentum": 0.0, "dampening": 0.0,
                                       "weight_decay": 0.0, "nesterov": False})

            def project(*_: object) -> None:
                with torch.no_grad():
                    alpha.clamp_(0.0, 1.0)

            optimizer.register_step_post_hook(project)
        return optimizer

    def train_locally(self, task: Task) -> float:
        if not self.trained:
            self.start_personal()
        self.mixed.train()
        return run_epochs(self.local_loss(task), self.local_optimizer_of_round(), self.train_x, self.train_y,
                          epochs=self.settings.local_epochs, batch_size=self.settings.batch_size,
                          generator=self.generator(task.round))

    def evaluate(self, task: Task) -> dict[str, float]:
        self.load_shared(task)
        global_accuracy = self.test_accuracy(self.model)
        if not self.trained:
            self.start_personal()
        return {"accuracy": self.test_accuracy(self.mixed), "global_accuracy": global_accuracy,
                "num_test": len(self.test_y)}

    # -- what stays ------------------------------------------------------------------------
    def personal_state(self) -> ArrayGroup:
        own = state_arrays(self.personal, list(self.personal.state_dict()))
        alpha = np.array(self.mixed.alpha.detach().cpu().numpy(), dtype=np.float32)
        return {**super().personal_state(), **{PERSONAL_MODEL + key: value for key, value in own.items()},
                MIXING_WEIGHT: alpha}

    def load_personal_state(self, arrays: ArrayGroup) -> None:
        check_arrays("personal", arrays, spec_of(self.personal_state()))
        alpha = float(arrays[MIXING_WEIGHT])
        if not 0 <= alpha <= 1:
            raise ValueError(f"personal/{MIXING_WEIGHT} must be in [0, 1], got {alpha}")
        load_arrays(self.model, {k: v for k, v in arrays.items() if k != MIXING_WEIGHT and
                                 not k.startswith(PERSONAL_MODEL)})
        load_arrays(self.personal, {k.removeprefix(PERSONAL_MODEL): v for k, v in arrays.items()
                                    if k.startswith(PERSONAL_MODEL)})
        with torch.no_grad():
            self.mixed.alpha.fill_(alpha)
        self.trained = True


DEVICE = ApflDevice
