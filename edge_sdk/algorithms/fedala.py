"""FedALA (Zhang et al., "FedALA: Adaptive Local Aggregation for Personalized Federated Learning",
AAAI 2023).

The device keeps its local model theta_i (all of it) between rounds. When the global model theta^t
comes down it is not loaded over theta_i: Adaptive Local Aggregation (ALA) builds the round's
initial local model

    theta_hat = theta_i + (theta^t - theta_i) ⊙ W_i

on the top layers (the last `layers` parameter tensors) and takes theta^t as it is below them,
with element-wise weights W_i in [0, 1], initialized to ones and kept on the device. W_i learns by
gradient steps on the loss of theta_hat over a random `sample_percent`% of the training split:

    W_i <- clip(W_i - eta * (theta^t - theta_i) ⊙ grad L(theta_hat), 0, 1)

(only W_i's gradient is taken; theta_i and theta^t are constants). Then the FedAvg local solver
trains theta_hat, and the trained model goes up as FedAvg's does and stays as the new theta_i.

Partition, up and down: as FedAvg (all parameters; BatchNorm running statistics stay on the
device). Deployed model: ALA applied to the global model that came down, on a copy (`accuracy`);
the global model with the device's statistics is scored as `global_accuracy`. `personal_state`
holds theta_i (parameters and statistics, the model's own keys), W_i (keys prefixed
`ala_weights.`) and how far the device is (`ala_stage`), so a restarted device resumes all three.

Decisions where the paper leaves a choice:
- The top layers are the last `layers` parameter tensors in `named_parameters` order: the default
  2 is the weight and bias of a linear `head`, the paper's p = 1 (its default, recalled); 4 adds
  the last Linear of the built-in CNN bodies, and so on down the body.
- A device without a local model (the first round it trains, a new client) takes theta^t
  (theta_i := theta^t), as the authors' code skips ALA while the two are equal. Its first ALA (the
  next round it trains) iterates until the standard deviation of the last `window` (10) iteration
  losses is below `threshold` (0.1, both the authors' code's defaults, recalled) after more than
  `window` iterations, and at most `max_iterations` (50, a cap of ours); every later ALA takes one
  iteration. An iteration is one pass over the sample in batches of the run's batch size, each
  batch one step of W_i (the authors' code); over a batch that holds the whole sample it is one
  gradient step. The loss it reports is the pass's mean (the authors' code: its last batch's).
- The sample is drawn anew every round, a random subset (the authors' code takes a contiguous
  slice at a random offset), from a generator of its own: the training batches are FedAvg's.
- The loss of theta_hat runs in training mode (batch statistics, as local training): a scratch
  copy of the network runs it, so theta_i's running statistics stay as they are; theta_hat keeps
  them (personal, as in FedAvg here). A trainer's own loss replaces cross-entropy there too.
- Evaluation applies ALA (the same stage's iterations) to a copy of theta_i and W_i and changes
  no personal state: the next round's fit runs its own ALA on the model that comes down then.
  The global body's statistics for a release are computed as every device's, theta_i kept.
- No DP-SGD (see `dp_sgd_refusal`).
"""

from __future__ import annotations

import copy
import statistics

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from ..params import check_arrays, spec_of
from ..protocol import ArrayGroup
from ..training import batches, load_arrays, state_arrays
from .base import FitResult, Task
from .hyper.fedala import Hyper as FedAlaHyper
from .part_sharing import SHARED, PartSharingDevice

ALA_WEIGHTS = "ala_weights."
"""Prefix of W_i's entries in the device's personal state."""
ALA_STAGE = "ala_stage"
"""The personal-state entry of the device's stage (an int8 scalar: FRESH, LOCAL or LEARNED)."""
FRESH, LOCAL, LEARNED = 0, 1, 2
"""No local model yet; a local model, W_i never learned; W_i learned (one iteration per round)."""
SAMPLE_STREAM = 0xA1A
"""Tells the sample's generator apart from the training batches' (`TorchDevice.generator`)."""

DP_SGD_REFUSAL = (
    "its adaptive local aggregation learns the weights W_i on a sample of the device's data outside "
    "DP-SGD, through a functional call whose parameters per-example gradient hooks cannot see, and "
    "the model that trains and goes up starts from them")
"""Why DP-SGD cannot train this algorithm (its `dp_sgd_refusal`)."""


class AggregatedNet(nn.Module):
    """theta_hat: `network` (which holds theta^t and the device's statistics, frozen) run with
    theta_i + (theta^t - theta_i) ⊙ W on the parameters `weights` names. Only `weights` carry
    gradients; `local` (theta_i's top layers) is a constant."""

    def __init__(self, network: nn.Module, local: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.network = network.requires_grad_(False)
        received = dict(network.named_parameters())
        self.differences = {name: received[name].detach() - local[name] for name in weights}
        self.local = local
        self.weights = {name: w.detach().clone().requires_grad_(True) for name, w in weights.items()}

    def top(self) -> dict[str, torch.Tensor]:
        """theta_hat's top layers."""
        return {name: self.local[name] + self.differences[name] * w for name, w in self.weights.items()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.network, self.top(), (x,))


class FedAlaDevice(PartSharingDevice):
    id = "fedala"
    display_name = "FedALA"
    citation = "Zhang et al. 2023"
    table_rank = 190
    Hyper = FedAlaHyper
    shared_parts = ("body", "head")
    dp_sgd_refusal = DP_SGD_REFUSAL

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        named = list(self.model.named_parameters())
        if self.hyper.layers > len(named):
            raise ValueError(f"fedala: layers = {self.hyper.layers}, but the model has {len(named)} parameter tensors")
        self.weights = {name: torch.ones_like(p, requires_grad=False) for name, p in named[-self.hyper.layers:]}
        """W_i, by parameter name: the top layers'."""
        self.stage = FRESH

    # -- adaptive local aggregation ---------------------------------------------------------
    def sample(self, round_: int) -> torch.Tensor:
        """Indices of round `round_`'s random `sample_percent`% of the training split (at least one)."""
        n = len(self.train_y)
        size = max(1, int(n * self.hyper.sample_percent / 100))
        seed = int(np.random.SeedSequence((self.client_seed, round_, SAMPLE_STREAM)).generate_state(1, np.uint64)[0])
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        return order[:size].to(self.train_y.device)

    def adapt(self, model: nn.Module, local: dict[str, torch.Tensor], stage: int,
              round_: int) -> tuple[dict[str, torch.Tensor], list[float]]:
        """ALA on `model`, which holds theta^t (and the device's statistics), from theta_i's top layers
        `local` and the device's W_i: learns W (until the loss settles at LOCAL, one iteration at
        LEARNED) and writes theta_hat's top layers into `model`. Returns the learned W and the
        loss of each iteration; the device's own W_i is left as it is."""
        net = AggregatedNet(copy.deepcopy(model), local, self.weights)
        loss_fn = self.objective(net)
        rows = self.sample(round_)
        iterations = self.hyper.max_iterations if stage == LOCAL else 1
        net.train()
        losses: list[float] = []
        for _ in range(iterations):
            total = torch.zeros((), device=rows.device)
            for idx in batches(len(rows), self.settings.batch_size, shuffle=False):
                batch = rows[idx]
                loss = loss_fn(self.train_x[batch], self.train_y[batch])
                grads = torch.autograd.grad(loss, list(net.weights.values()))
                with torch.no_grad():
                    for w, g in zip(net.weights.values(), grads, strict=True):
                        w.sub_(self.hyper.eta * g).clamp_(0.0, 1.0)
                total += loss.detach() * len(batch)
            losses.append(float(total) / len(rows))
            if self.settled(losses):
                break
        parameters = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in net.top().items():
                parameters[name].copy_(value)
        return {name: w.detach() for name, w in net.weights.items()}, losses

    def settled(self, losses: list[float]) -> bool:
        """More than `window` iterations, and the last `window` losses' (population) standard
        deviation below `threshold`."""
        window = self.hyper.window
        return len(losses) > window and statistics.pstdev(losses[-window:]) < self.hyper.threshold

    def top_layers(self) -> dict[str, torch.Tensor]:
        """theta_i's top layers as they are now (copies)."""
        return {name: p.detach().clone() for name, p in self.model.named_parameters() if name in self.weights}

    def initialize_local_model(self, task: Task) -> list[float]:
        """The round's initial local model in `self.model`: theta^t for a device without a local
        model, else theta_hat by ALA, W_i learned. Returns the ALA's iteration losses (none for
        theta^t)."""
        local = self.top_layers()
        self.load_shared(task)
        if self.stage == FRESH:
            self.stage = LOCAL
            return []
        self.weights, losses = self.adapt(self.model, local, self.stage, task.round)
        self.stage = LEARNED
        return losses

    # -- a round ---------------------------------------------------------------------------
    def fit(self, task: Task) -> FitResult:
        self.initialize_local_model(task)
        loss = self.train_locally(task)
        return FitResult({SHARED: self.shared_state()}, {"num_examples": len(self.train_y), "loss": loss})

    def evaluate(self, task: Task) -> dict[str, float]:
        deployed = copy.deepcopy(self.model)
        self.load_shared(task, deployed)
        global_accuracy = self.test_accuracy(deployed)
        if self.stage != FRESH:
            self.adapt(deployed, self.top_layers(), self.stage, task.round)
        return {"accuracy": self.test_accuracy(deployed), "global_accuracy": global_accuracy,
                "num_test": len(self.test_y)}

    def body_statistics(self, task: Task) -> ArrayGroup:
        """The global body's statistics on the training split, as every device computes them
        (`TorchDevice.body_statistics`), with theta_i restored after: that computation loads the
        global body into the device's model, which holds theta_i here."""
        local = state_arrays(self.model, list(self.model.state_dict()))
        try:
            return super().body_statistics(task)
        finally:
            load_arrays(self.model, local)

    # -- what stays ------------------------------------------------------------------------
    def personal_state(self) -> ArrayGroup:
        own = state_arrays(self.model, list(self.model.state_dict()))
        weights = {ALA_WEIGHTS + name: w.detach().cpu().numpy().copy() for name, w in self.weights.items()}
        return {**own, **weights, ALA_STAGE: np.array(self.stage, dtype=np.int8)}

    def load_personal_state(self, arrays: ArrayGroup) -> None:
        check_arrays("personal", arrays, spec_of(self.personal_state()))
        stage = int(arrays[ALA_STAGE])
        if stage not in (FRESH, LOCAL, LEARNED):
            raise ValueError(f"personal/{ALA_STAGE} must be {FRESH}, {LOCAL} or {LEARNED}, got {stage}")
        weights = {k.removeprefix(ALA_WEIGHTS): v for k, v in arrays.items() if k.startswith(ALA_WEIGHTS)}
        for name, w in weights.items():
            if not ((w >= 0) & (w <= 1)).all():
                raise ValueError(f"personal/{ALA_WEIGHTS}{name} must lie in [0, 1]")
        load_arrays(self.model, {k: v for k, v in arrays.items() if k != ALA_STAGE and not k.startswith(ALA_WEIGHTS)})
        self.weights = {name: torch.as_tensor(np.array(w), device=self.device) for name, w in weights.items()}
        self.stage = stage


DEVICE = FedAlaDevice
