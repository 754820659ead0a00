"""CD2-pFed (Shen et al., CVPR 2022): channel-wise decoupling with cyclic distillation.

Paper: docs/ALGORITHMS.md, "References". Every layer's output channels are split into shared channels (w0,
federated) and personal channels (w_i, never leave the device).

- Eq. (3): the personal fraction grows linearly, p_t = p * t / T (t = round, T = rounds).
  Ablation `ramp=false` (Table 5's "w/o LI", linear increase): p_t = p from round 1, so every
  round, the first included, splits and uploads as the ramp's last round does.
- Partition, Decision (the paper leaves the mechanics open): in each hidden conv/linear layer
  the *last* round(p_t * C_out) output channels are personal: those rows of the weight, the bias
  and the BatchNorm affine parameters. For the classifier `head`, whose outputs are classes, the split is
  along the *input* columns (the columns fed by personal features); its bias is shared. Every
  `body` parameter is split along dim 0 with round(p_t * size(0)) personal entries, so a BN layer
  splits exactly like the conv before it. round() rounds halves up. BN running statistics are
  personal, as everywhere.
- Sub-networks: g_w0 is the forward pass with the personal entries masked to zero, g_wi the one
  with the shared entries masked to zero; the full network g_{wi,w0} uses both.
- Eq. (4)-(5): L = CE(g_{wi,w0}(x), y) + lambda * L_CD, p_L = softmax(g_wi(x)),
  p_G = softmax(g_w0(x)), p_F = softmax(g_{wi,w0}(x)); in every KL term the first (target)
  distribution is detached, so KL(p_L || p_G) trains g_w0 and KL(p_G || p_L) trains g_wi.
  Eq. (4) as written (`distillation = "cyclic"`): L_CD = 1/2 (KL(p_L || p_G) + KL(p_G || p_L)), the
  1/2 included.
  Decision (L_CD; departs from the printed Eq. 4-5): the default
  `distillation = "cyclic+inplace"` adds the in-place distillation the paper cites only as the
  motivation of its design (its ref. 43, Yu and Huang's universally slimmable networks: the full
  network's prediction, detached, teaches the sub-networks):
  L_CD = 1/2 (KL(p_F || p_G) + KL(p_F || p_L)) + 1/2 (KL(p_L || p_G) + KL(p_G || p_L)).
  The first half is not in the paper's printed equations; `distillation = "cyclic"` keeps them exactly.
  Why: only the full network sees labels, so with Eq. (4) alone nothing ties the masked
  sub-networks to the task and the cheapest agreement of two sub-networks is two near-uniform
  predictions (measured: the shared sub-network's entropy 2.29 of ln 10 = 2.30, its
  `global_accuracy` 10.2-10.8% in the 20-device tables). The in-place term gives both sub-networks the
  full network's soft labels, and the Eq. (4) term keeps the mutual consistency the paper asks
  for; `"inplace"` keeps the in-place term alone. Measured (Fashion-MNIST `domains`, 10 devices x
  10 rounds, benchmarks/docs/papers.md "CD2-pFed's distillation"): shared sub-network 65.3% with
  cyclic+inplace, 64.8% inplace, 32.9% Eq. (4) alone, 41.5% without CD; personalized accuracy
  79.5%, 80.0%, 78.8% and 79.8%: the paper's Table 5 gain of CD (1.3-1.5 points) is not
  reproduced there.
- Eq. (6)-(7): after each local epoch l the personal entries are smoothed,
  w_i^l = beta_t w'_i^l + (1 - beta_t) w_i^{l-1}, beta_t = beta exp(-5 (1 - t/t0)^2) for
  t <= t0 = 0.1 T, else beta (beta = 0.5); w_i^{l-1} is the personal value before the epoch.
- Optimizer (Sec. 4.2): SGD, Nesterov momentum 0.9, weight decay 5e-4, lr from the run's --lr.

Down, round t: the global shared slices of round t-1 (the last aggregated round; full tensors
before round 1), loaded into the leading entries of each tensor. Channels that turn personal in
round t thus start from the global value (Alg. 1: download w0^{t-1}, then update p).
Up, round t: only the shared slice of every parameter for p_t (group `shared`), so the upload
shrinks as p_t grows; the server averages them entry by entry (FedAvg, weighted by n_k).
Deployed model: the full network; `global_accuracy` scores the shared sub-network g_w0 with its
own BatchNorm running statistics (kept on the device, updated by the g_w0 training passes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call

from ..models import statistics_keys
from ..models.capabilities import CHANNEL_STRUCTURE, COMMON, LINEAR_HEAD
from ..params import ArraySpec, check_arrays, part_of, spec_of
from ..protocol import ArrayGroup
from ..training import LossFn, accuracy, eval_mode, load_arrays, run_epochs, state_arrays
from .base import FitResult, Task
from .hyper.cd2_pfed import Hyper
from .torch_device import SHARED, TorchDevice

GW0_PREFIX = "g_w0."
"""Prefix of the shared sub-network's BatchNorm statistics in the device's personal state."""

Shape = tuple[int, ...]
Cut = tuple[int | None, int]
"""(axis, number of shared entries along it); axis None: the whole tensor is shared."""


# -- the schedule and the split (both sides use these) -------------------------------------
def personal_fraction(p: float, round_: int, rounds: int, ramp: bool = True) -> float:
    """Eq. (3): p_t = p * t / T, with t clipped to [0, T]; without the ramp p from round 1 on
    (before round 1, p_0 = 0 either way: the initial global state is whole)."""
    if not ramp:
        return p if round_ >= 1 else 0.0
    return p * min(max(round_, 0), rounds) / rounds


def ema_coefficient(beta: float, round_: int, rounds: int, warmup: float) -> float:
    """Eq. (7): beta * exp(-5 (1 - t/t0)^2) while t <= t0 = warmup * T, then beta."""
    t0 = warmup * rounds
    if t0 > 0 and round_ <= t0:
        return beta * math.exp(-5.0 * (1.0 - round_ / t0) ** 2)
    return beta


def personal_count(size: int, fraction: float) -> int:
    """round(fraction * size), halves rounded up."""
    return int(math.floor(fraction * size + 0.5))


def split_axis(key: str, ndim: int) -> int | None:
    """Axis along which parameter `key` splits: inputs of the head's weight, outputs elsewhere."""
    if ndim == 0:
        return None
    if part_of(key) == "head":
        return 1 if ndim == 2 else None
    return 0


def channel_cuts(shapes: Mapping[str, Shape], fraction: float) -> dict[str, Cut]:
    """For every parameter: the split axis and how many leading entries along it are shared."""
    cuts: dict[str, Cut] = {}
    for key, shape in shapes.items():
        axis = split_axis(key, len(shape))
        if axis is None:
            cuts[key] = (None, 0)
        else:
            cuts[key] = (axis, shape[axis] - personal_count(shape[axis], fraction))
    return cuts


def shared_index(shape: Shape, cut: Cut) -> tuple[slice, ...]:
    """Index of the shared entries (a leading slice along the cut axis)."""
    axis, n_shared = cut
    if axis is None:
        return tuple(slice(None) for _ in shape)
    return tuple(slice(0, n_shared) if dim == axis else slice(None) for dim in range(len(shape)))


def shared_shape(shape: Shape, cut: Cut) -> Shape:
    axis, n_shared = cut
    return shape if axis is None else tuple(n_shared if dim == axis else s for dim, s in enumerate(shape))


def upload_spec(shapes: Mapping[str, Shape], fraction: float, dtype: str = "float32") -> ArraySpec:
    """Exact names, shapes and dtypes of an upload at personal fraction `fraction`."""
    cuts = channel_cuts(shapes, fraction)
    return {key: (shared_shape(shape, cuts[key]), dtype) for key, shape in shapes.items()}


def personal_masks(shapes: Mapping[str, Shape], fraction: float, device: torch.device) -> dict[str, torch.Tensor]:
    """Boolean masks, True on the personal entries of every parameter."""
    masks = {}
    for key, cut in channel_cuts(shapes, fraction).items():
        mask = torch.ones(shapes[key], dtype=torch.bool, device=device)
        mask[shared_index(shapes[key], cut)] = False
        masks[key] = mask
    return masks


# -- the loss -------------------------------------------------------------------------------
def distill(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """KL(softmax(teacher) || softmax(student)), mean over the batch; the teacher is detached."""
    return F.kl_div(F.log_softmax(student, dim=1), F.log_softmax(teacher.detach(), dim=1), log_target=True,
                    reduction="batchmean")


def cyclic_distillation(logits_local: torch.Tensor, logits_global: torch.Tensor) -> torch.Tensor:
    """Eq. (4): 1/2 (KL(p_L || p_G) + KL(p_G || p_L)), the target side of each term detached."""
    return 0.5 * (distill(logits_local, logits_global) + distill(logits_global, logits_local))


def inplace_distillation(logits_full: torch.Tensor, logits_local: torch.Tensor,
                         logits_global: torch.Tensor) -> torch.Tensor:
    """Ref. 43's in-place distillation: 1/2 (KL(p_F || p_G) + KL(p_F || p_L)), p_F detached."""
    return 0.5 * (distill(logits_full, logits_global) + distill(logits_full, logits_local))


def distillation_loss(kind: str, logits_full: torch.Tensor, logits_local: torch.Tensor,
                      logits_global: torch.Tensor) -> torch.Tensor:
    """L_CD of form `kind` (Hyper.distillation): cyclic+inplace, inplace or cyclic."""
    if kind == "cyclic":
        return cyclic_distillation(logits_local, logits_global)
    inplace = inplace_distillation(logits_full, logits_local, logits_global)
    if kind == "inplace":
        return inplace
    return inplace + cyclic_distillation(logits_local, logits_global)


class CD2PFedDevice(TorchDevice):
    """Full network trained with CE + cyclic distillation; only the shared channels travel."""

    id = "cd2_pfed"
    display_name = "CD2-pFed"
    citation = "CD2-pFed"
    table_rank = 110
    paper_method = True
    Hyper = Hyper
    requires = (*COMMON, LINEAR_HEAD, CHANNEL_STRUCTURE)
    dp_sgd_refusal = ("its distillation runs the network with masked weights (functional passes on parameter x "
                      "mask), which per-layer per-example gradients do not see, and the personal channels are "
                      "smoothed outside the optimizer's steps")
    shared_parts = ("body", "head")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.shapes: dict[str, Shape] = {k: tuple(p.shape) for k, p in self.model.named_parameters()}
        state = self.model.state_dict()
        # BatchNorm running statistics of the shared sub-network g_w0 (used by global_accuracy).
        self.gw0_stats = {k: state[k].detach().clone() for k in sorted(statistics_keys(self.model))}

    # -- the split at a round --------------------------------------------------------------
    def fraction(self, round_: int) -> float:
        return personal_fraction(self.hyper.p, round_, self.settings.rounds, self.hyper.ramp)

    def masks(self, round_: int) -> dict[str, torch.Tensor]:
        return personal_masks(self.shapes, self.fraction(round_), self.device)

    # -- what travels ----------------------------------------------------------------------
    def load_shared(self, task: Task, model: torch.nn.Module | None = None) -> None:
        """Load the global shared slices (of the last aggregated round) into the leading entries
        of `model` (default: the device's)."""
        arrays = task.groups.get(SHARED)
        if arrays is None:
            return
        check_arrays(SHARED, arrays, self._broadcast_spec(arrays))
        params = dict((self.model if model is None else model).named_parameters())
        with torch.no_grad():
            for key, value in arrays.items():
                shape = self.shapes[key]
                axis = split_axis(key, len(shape))
                index = shared_index(shape, (axis, value.shape[axis] if axis is not None else 0))
                params[key][index] = torch.as_tensor(np.array(value), device=self.device)

    def _broadcast_spec(self, arrays: ArrayGroup) -> ArraySpec:
        """What a broadcast may look like: a leading slice of each parameter along its split axis."""
        spec: ArraySpec = {}
        for key, shape in self.shapes.items():
            axis = split_axis(key, len(shape))
            value = arrays.get(key)
            n = shape[axis] if axis is not None else 0
            if axis is not None and value is not None and value.ndim == len(shape):
                n = min(value.shape[axis], shape[axis])
            spec[key] = (shared_shape(shape, (axis, n)), "float32")
        return spec

    def upload(self, round_: int) -> ArrayGroup:
        """The shared slice of every parameter at round `round_`; personal entries stay here."""
        cuts = channel_cuts(self.shapes, self.fraction(round_))
        params = dict(self.model.named_parameters())
        return {
            key: params[key].detach()[shared_index(shape, cuts[key])].cpu().numpy().copy()
            for key, shape in self.shapes.items()
        }

    def personal_state(self) -> ArrayGroup:
        """The whole model (its shared entries are overwritten by the next broadcast) and g_w0's
        BatchNorm statistics."""
        model_state = state_arrays(self.model, list(self.model.state_dict()))
        gw0 = {GW0_PREFIX + k: v.cpu().numpy().copy() for k, v in self.gw0_stats.items()}
        return {**model_state, **gw0}

    def load_personal_state(self, arrays: ArrayGroup) -> None:
        check_arrays("personal", arrays, spec_of(self.personal_state()))
        load_arrays(self.model, {k: v for k, v in arrays.items() if not k.startswith(GW0_PREFIX)})
        with torch.no_grad():
            for key, stat in self.gw0_stats.items():
                stat.copy_(torch.as_tensor(np.array(arrays[GW0_PREFIX + key]), device=stat.device))

    # -- sub-networks ----------------------------------------------------------------------
    def subnet_logits(self, x: torch.Tensor, keep: Mapping[str, torch.Tensor],
                      stats: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Forward pass with every parameter multiplied by `keep` and BN statistics `stats`."""
        params = {key: param * keep[key] for key, param in self.model.named_parameters()}
        return functional_call(self.model, {**params, **stats}, (x,))

    # -- local work ------------------------------------------------------------------------
    def optimizer(self, params=None) -> torch.optim.Optimizer:
        """Sec. 4.2: SGD, Nesterov momentum, weight decay (or the run's common optimizer)."""
        params = self.model.parameters() if params is None else params
        return self.local_optimizer(params, lambda own: torch.optim.SGD(
            own, lr=self.settings.lr, momentum=self.hyper.momentum, nesterov=self.hyper.momentum > 0,
            weight_decay=self.hyper.weight_decay))

    def local_loss(self, task: Task) -> LossFn:
        """Eq. (5): CE of the full network + lambda * L_CD of g_wi and g_w0 (the Decision's form)."""
        masks = self.masks(task.round)
        keep_shared = {k: (~m).to(torch.float32) for k, m in masks.items()}
        keep_personal = {k: m.to(torch.float32) for k, m in masks.items()}
        # g_wi's running statistics are never used: its passes update a scratch copy.
        scratch = {k: v.clone() for k, v in self.gw0_stats.items()}

        def loss(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            logits_full = self.model(xb)
            ce = F.cross_entropy(logits_full, yb)
            logits_global = self.subnet_logits(xb, keep_shared, self.gw0_stats)
            logits_local = self.subnet_logits(xb, keep_personal, scratch)
            return ce + self.hyper.lam * distillation_loss(self.hyper.distillation, logits_full, logits_local,
                                                           logits_global)

        return loss

    def smooth_personal(self, before: Mapping[str, torch.Tensor], masks: Mapping[str, torch.Tensor],
                        beta_t: float) -> None:
        """Eq. (6): personal entries <- beta_t * new + (1 - beta_t) * value before the epoch."""
        with torch.no_grad():
            for key, param in self.model.named_parameters():
                smoothed = beta_t * param + (1.0 - beta_t) * before[key]
                param.copy_(torch.where(masks[key], smoothed, param))

    def train_locally(self, task: Task) -> float:
        self.model.train()
        masks = self.masks(task.round)
        beta_t = ema_coefficient(self.hyper.beta, task.round, self.settings.rounds, self.hyper.warmup)
        loss_fn, optimizer, generator = self.local_loss(task), self.optimizer(), self.generator(task.round)
        loss = float("nan")
        for _ in range(self.settings.local_epochs):
            before = {k: p.detach().clone() for k, p in self.model.named_parameters()}
            loss = run_epochs(loss_fn, optimizer, self.train_x, self.train_y, epochs=1,
                              batch_size=self.settings.batch_size, generator=generator)
            self.smooth_personal(before, masks, beta_t)
        return loss

    def fit(self, task: Task) -> FitResult:
        self.load_shared(task)
        loss = self.train_locally(task)
        metrics = {"num_examples": len(self.train_y), "loss": loss, "personal_fraction": self.fraction(task.round)}
        return FitResult({SHARED: self.upload(task.round)}, metrics)

    def evaluate(self, task: Task) -> dict[str, float]:
        """Personalized: the full network. Global: the shared sub-network g_w0."""
        self.load_shared(task)
        keep_shared = {k: (~m).to(torch.float32) for k, m in self.masks(task.round).items()}
        with eval_mode(self.model):
            personal = accuracy(self.model, self.test_x, self.test_y)
            shared = accuracy(lambda xb: self.subnet_logits(xb, keep_shared, self.gw0_stats), self.test_x, self.test_y)
        return {"accuracy": personal, "global_accuracy": shared, "num_test": len(self.test_y)}


DEVICE = CD2PFedDevice
