"""Record-level differential privacy of local training: DP-SGD (Abadi et al., 2016) through Opacus.

Inside `dp_sgd(trainer)`, every `edge_sdk.training.run_epochs` call trains with DP-SGD instead of
its shuffled batches: each step draws a Poisson batch (every training example independently with
probability q = batch_size / n), takes each example's gradient over the optimizer's parameters
only (Opacus's per-layer hooks, `GradSampleHooks`; the module's other parameters are frozen for
the call), clips it to L2 norm C (`dp_sgd_clip`), sums, adds
Gaussian noise of standard deviation z*C (`dp_sgd_noise`, Opacus's `DPOptimizer` in its secure
mode) and divides by the expected batch size q*n. Every step is recorded in the device's
`DpSgdAccountant`, whose history of (q, z, steps) survives a restart in the personal store.

Amplification by sampling (the accountant's q) holds only while nobody can tell which records a
step sampled, so the batches are drawn from a generator seeded from the operating system's
entropy, of this `DpSgd` alone. Under `dp_reproducible_noise` they come from the training loop's
generator instead, which the run's seed, the device and the round determine (all three are in
WELCOME and the report): the run repeats, and each step is accounted without amplification, at
q = 1 (`Steps.rate`), whatever its batch's rate.

Guaranteed, per device: the sequence of noised parameter updates it computed over the whole run,
and everything computed from them alone (its uploads, its deployed model, accuracy on its test
split), is (epsilon, delta)-DP with respect to adding or removing one record of its training split,
with epsilon from Google's dp-accounting RDP accountant over every step it has taken
(`PoissonSampledDpEvent(q, GaussianDpEvent(z))` composed `steps` times; q = 1 for batches from the
run's seed), at the device's delta (`PrivacySettings.dp_sgd_delta_for` its training examples).
FedProx's proximal term is a function of the parameters and the broadcast global model only: its
gradient is added after the noise (`PenalizedLoss`), which is post-processing.

Not guaranteed: anything a device computes from its records outside the DP-SGD steps: the
measured training loss `run_epochs` returns (`released_fit_metrics` leaves it out), the number of
training examples and label counts, BatchNorm statistics (such models are refused), and any
training done outside the `dp_sgd` block. The guarantee is per device and per record, not per
user across devices, and is not user-level DP of the uploads (that is `--dp`). The noise and the
batches come from torch's Mersenne Twister seeded from the operating system (the noise from the
run's seed under `dp_reproducible_noise`), not a cryptographic generator. Epsilon is an upper bound from RDP,
not a tight (PLD) figure.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import os
import secrets
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .rdp import rdp_orders

if TYPE_CHECKING:
    from ..algorithms.base import DeviceAlgorithm
    from ..protocol import ArrayGroup
    from .settings import PrivacySettings

log = logging.getLogger(__name__)

DP_SGD_EPSILON = "dp_sgd_epsilon"
"""The metric a device reports: its record-level epsilon so far, at its DP-SGD delta."""
ACCOUNTANT_KEY = "dp_sgd_history"
"""The personal-store array of the accountant: rows of (sample rate, noise multiplier, steps)."""

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class DpSgdRefused(ValueError):
    """DP-SGD asked of an algorithm, model or loss whose per-example gradients do not exist."""


# -- what may train with DP-SGD ------------------------------------------------------------------
def first_batchnorm(model: nn.Module) -> str | None:
    """The name of `model`'s first BatchNorm module, or None."""
    return next((name for name, module in model.named_modules() if isinstance(module, _BatchNorm)), None)


def check_dp_sgd(algorithm_cls: type[DeviceAlgorithm], model: nn.Module, *, own_loss: bool = False) -> None:
    """Raise DpSgdRefused, naming why, unless `algorithm_cls` may train `model` with DP-SGD: the
    algorithm declares its local loss a mean of per-example terms (`dp_sgd_refusal` is None), no
    module mixes the examples of a batch (BatchNorm) or keeps buffers Opacus cannot differentiate
    per example, and no trainer's own loss (`own_loss`) replaces cross-entropy: a loss given as a
    function of a whole batch cannot be checked to be a mean over its examples (class weights, for
    one, are normalized over the batch)."""
    from opacus.grad_sample import GradSampleHooks

    reason = algorithm_cls.dp_sgd_refusal
    if reason is not None:
        raise DpSgdRefused(f"--dp-sgd is refused for {algorithm_cls.id}: {reason}")
    batchnorm = first_batchnorm(model)
    if batchnorm is not None:
        kind = type(model.get_submodule(batchnorm)).__name__
        raise DpSgdRefused(f"--dp-sgd is refused for this model: its module {batchnorm!r} ({kind}) normalizes "
                           f"over the batch, so one example's gradient depends on the others (no per-example "
                           f"gradient exists); use a model without BatchNorm (GroupNorm or LayerNorm instead)")
    errors = GradSampleHooks.validate(model)
    if errors:
        raise DpSgdRefused(f"--dp-sgd is refused for this model: {errors[0]}")
    if own_loss:
        raise DpSgdRefused("--dp-sgd is refused with a trainer's own loss: it is given the whole batch, so it "
                           "cannot be checked to be a mean of per-example terms; leave it out (cross-entropy)")


# -- the accountant -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Steps:
    """`count` DP-SGD steps at sample rate `rate` (q) and noise multiplier `noise` (z); steps whose
    batches were drawn from a known seed are recorded at rate 1 (no amplification)."""

    rate: float
    noise: float
    count: int


class DpSgdAccountant:
    """Every DP-SGD step a device has taken in the run, and its record-level epsilon over them."""

    def __init__(self, history: list[Steps] | None = None) -> None:
        self.history: list[Steps] = list(history or [])

    def record(self, rate: float, noise: float, count: int = 1) -> None:
        """Add `count` steps at (q, z), merged into the last entry when q and z are its own."""
        if count <= 0:
            return
        last = self.history[-1] if self.history else None
        if last is not None and (last.rate, last.noise) == (rate, noise):
            self.history[-1] = Steps(rate, noise, last.count + count)
        else:
            self.history.append(Steps(rate, noise, count))

    @property
    def steps(self) -> int:
        return sum(entry.count for entry in self.history)

    def epsilon(self, delta: float) -> float:
        """Epsilon at `delta` of all the recorded steps composed (0 with none; inf with zero noise):
        dp-accounting's RDP accountant, add-or-remove-one neighbouring."""
        import dp_accounting
        from dp_accounting.rdp import RdpAccountant

        if not self.history:
            return 0.0
        if any(entry.noise == 0 for entry in self.history):
            return math.inf
        accountant = RdpAccountant(list(rdp_orders()))
        for entry in self.history:
            event = dp_accounting.PoissonSampledDpEvent(entry.rate, dp_accounting.GaussianDpEvent(entry.noise))
            accountant.compose(event, entry.count)
        return float(accountant.get_epsilon(delta))

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The history as one float64 array [k, 3] for the personal store (never sent upstream)."""
        rows = [(entry.rate, entry.noise, float(entry.count)) for entry in self.history]
        return {ACCOUNTANT_KEY: np.array(rows, dtype=np.float64).reshape(len(rows), 3)}

    @classmethod
    def from_arrays(cls, arrays: ArrayGroup) -> DpSgdAccountant:
        """The accountant `to_arrays` saved (an empty one if `arrays` has none); ValueError for a
        history that is not rows of q in (0, 1], z >= 0 and a whole count >= 0."""
        if ACCOUNTANT_KEY not in arrays:
            return cls()
        table = np.asarray(arrays[ACCOUNTANT_KEY], dtype=np.float64)
        if table.ndim != 2 or table.shape[1] != 3 or not np.isfinite(table).all():
            raise ValueError(f"{ACCOUNTANT_KEY} must be a finite [k, 3] array, got shape {table.shape}")
        history = []
        for rate, noise, count in table:
            if not (0 < rate <= 1 and noise >= 0 and count >= 0 and count == int(count)):
                raise ValueError(f"{ACCOUNTANT_KEY} holds an impossible row (q={rate}, z={noise}, steps={count})")
            history.append(Steps(float(rate), float(noise), int(count)))
        return cls(history)


def released_fit_metrics(metrics: dict[str, float], epsilon: float) -> dict[str, float]:
    """What a device under DP-SGD reports of a round: `num_examples` (outside the guarantee, as
    FedAvg's weights need it) and its epsilon; the measured losses stay on the device."""
    released = {DP_SGD_EPSILON: epsilon}
    if "num_examples" in metrics:
        released["num_examples"] = metrics["num_examples"]
    return released


# -- a loss with a part that sees no record ----------------------------------------------------------
@dataclass(frozen=True)
class PenalizedLoss:
    """`per_example(x, y) + penalty()`: a mean of per-example terms plus a function of the
    parameters alone (FedProx's proximal term). Outside DP-SGD it is just their sum; DP-SGD clips
    and noises the first part's per-example gradients and adds the penalty's gradient after."""

    per_example: LossFn
    penalty: Callable[[], torch.Tensor]

    def __call__(self, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return self.per_example(xb, yb) + self.penalty()


# -- the training loop -------------------------------------------------------------------------------
class DpSgd:
    """A device's DP-SGD: noise multiplier z, per-example clipping norm C, its accountant, the
    generator of its noise (from `noise_seed`, or the operating system's entropy when None) and
    where its batches come from: a generator of its own seeded from the operating system's
    entropy, secret, so that each step is accounted with amplification by sampling; or, with
    `reproducible`, the generator the training loop passes (the run's seed), each step accounted
    without amplification (q = 1)."""

    def __init__(self, noise_multiplier: float, max_grad_norm: float, accountant: DpSgdAccountant | None = None,
                 noise_seed: int | None = None, *, reproducible: bool = False) -> None:
        if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
            raise ValueError(f"noise multiplier must be finite and >= 0, got {noise_multiplier}")
        if not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
            raise ValueError(f"per-example clipping norm must be finite and positive, got {max_grad_norm}")
        self.noise_multiplier = noise_multiplier
        self.max_grad_norm = max_grad_norm
        self.accountant = accountant if accountant is not None else DpSgdAccountant()
        self.noise_seed = secrets.randbits(63) if noise_seed is None else noise_seed
        self.reproducible = reproducible
        self._generators: dict[torch.device, torch.Generator] = {}
        self._secret_batches = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))

    @classmethod
    def from_settings(cls, privacy: PrivacySettings, accountant: DpSgdAccountant | None = None,
                      noise_seed: int | None = None) -> DpSgd:
        """The `[privacy]` section's DP-SGD (`dp_sgd_noise`, `dp_sgd_clip`; batches from the run's
        seed under `dp_reproducible_noise`)."""
        return cls(privacy.dp_sgd_noise, privacy.dp_sgd_clip, accountant, noise_seed,
                   reproducible=privacy.dp_reproducible_noise)

    def noise_generator(self, device: torch.device) -> torch.Generator:
        """One generator per torch device, kept for the device's whole run (one stream of noise)."""
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.noise_seed)
        return self._generators[device]

    def accounted_rate(self, rate: float) -> float:
        """The sample rate a step of batch rate `rate` is accounted at: `rate` with secret batches,
        1 with batches from the run's seed (no amplification)."""
        return 1.0 if self.reproducible else rate

    def run_epochs(self, loss_fn: LossFn, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, *,
                   epochs: int, batch_size: int, generator: torch.Generator, module: nn.Module | None,
                   max_norm: float = 0.0) -> float:
        """`epochs` x ceil(n / batch_size) DP-SGD steps on the optimizer's parameters of `module`
        (the network `loss_fn` runs; its other parameters are frozen meanwhile); `generator` draws
        the batches only when `reproducible`. After the noise,
        the gradient of a `PenalizedLoss`'s penalty is added and, with `max_norm` > 0, the step is
        scaled to that norm (both post-processing). Returns the mean measured loss over the last
        epoch's sampled examples (NaN for none): a figure of the records, not to be released."""
        if module is None:
            raise DpSgdRefused("--dp-sgd: this training loop does not name the module it trains "
                               "(run_epochs(..., module=...)), so no per-example gradient can be taken")
        n = len(y)
        trained = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        if epochs <= 0 or n == 0 or not trained:
            return float("nan")
        owned = {id(p) for p in module.parameters()}
        if any(id(p) not in owned for p in trained):
            raise DpSgdRefused("--dp-sgd: the optimizer trains parameters outside the module named to run_epochs")
        chosen = {id(p) for p in trained}
        frozen = [p for p in module.parameters() if p.requires_grad and id(p) not in chosen]
        # an in-place activation would write into the output Opacus's hooks keep (ReLU(inplace=True))
        in_place = [layer for layer in module.modules() if getattr(layer, "inplace", False) is True]
        for param in frozen:
            param.requires_grad_(False)
        for layer in in_place:
            setattr(layer, "inplace", False)  # noqa: B010  (not every module declares it)
        try:
            return self._steps(loss_fn, optimizer, trained, x, y, epochs, batch_size, generator, module, max_norm)
        finally:
            for param in frozen:
                param.requires_grad_(True)
            for layer in in_place:
                setattr(layer, "inplace", True)  # noqa: B010

    def _steps(self, loss_fn: LossFn, optimizer: torch.optim.Optimizer, trained: list[nn.Parameter],
               x: torch.Tensor, y: torch.Tensor, epochs: int, batch_size: int, generator: torch.Generator,
               module: nn.Module, max_norm: float) -> float:
        """The DP-SGD steps themselves, with Opacus's hooks on `module` for their duration."""
        from opacus.grad_sample import GradSampleHooks
        from opacus.optimizers import DPOptimizer

        n = len(y)
        rate = min(1.0, batch_size / n)
        per_epoch = math.ceil(n / batch_size)
        per_example, penalty = ((loss_fn.per_example, loss_fn.penalty) if isinstance(loss_fn, PenalizedLoss)
                                else (loss_fn, None))
        hooks = GradSampleHooks(module, batch_first=True, loss_reduction="mean", strict=True)
        private = DPOptimizer(optimizer, noise_multiplier=self.noise_multiplier, max_grad_norm=self.max_grad_norm,
                              expected_batch_size=rate * n, loss_reduction="mean",
                              generator=self.noise_generator(trained[0].device), secure_mode=True)
        batches = generator if self.reproducible else self._secret_batches
        mean_loss = float("nan")
        try:
            for _ in range(epochs):
                total, count = torch.zeros((), device=x.device), 0
                for _ in range(per_epoch):
                    idx = torch.nonzero(torch.rand(n, generator=batches) < rate).flatten()
                    private.zero_grad(set_to_none=True)
                    if len(idx) > 0:
                        loss = per_example(x[idx], y[idx])
                        with warnings.catch_warnings():  # inputs need no gradient: Opacus's hooks want the outputs'
                            warnings.filterwarnings("ignore", message="Full backward hook is firing")
                            loss.backward()
                        total += loss.detach().float() * len(idx)
                        count += len(idx)
                    _fill_missing_grad_samples(trained, len(idx))
                    private.pre_step()  # clip each example, sum, add noise, divide by q*n: p.grad
                    self.accountant.record(self.accounted_rate(rate), self.noise_multiplier)
                    if penalty is not None:
                        _add_penalty_gradient(penalty, trained)
                    if max_norm > 0:
                        nn.utils.clip_grad_norm_(trained, max_norm)
                    optimizer.step()
                if count:
                    mean_loss = float(total) / count
        finally:
            hooks.cleanup()
            _forget_opacus_state(module)
        return mean_loss


def _fill_missing_grad_samples(params: list[nn.Parameter], batch: int) -> None:
    """Zero per-example gradients for parameters the pass did not reach (an empty batch, an
    unused layer): their examples contribute nothing, and the step still adds its noise."""
    for param in params:
        if getattr(param, "grad_sample", None) is None:
            param.grad_sample = torch.zeros(  # type: ignore[attr-defined]  # Opacus's attribute
                (batch, *param.shape), device=param.device, dtype=param.dtype)


def _add_penalty_gradient(penalty: Callable[[], torch.Tensor], params: list[nn.Parameter]) -> None:
    """Add the gradient of a parameter-only term to the private gradient (post-processing)."""
    grads = torch.autograd.grad(penalty(), params, allow_unused=True)
    with torch.no_grad():
        for param, grad in zip(params, grads, strict=True):
            if grad is not None and param.grad is not None:
                param.grad += grad


def _forget_opacus_state(module: nn.Module) -> None:
    """Drop what Opacus leaves on layers (after an interrupted pass) and parameters (the summed
    gradients of the last step)."""
    for layer in module.modules():
        for attribute in ("activations", "max_batch_len"):
            if hasattr(layer, attribute):
                delattr(layer, attribute)
    for param in module.parameters():
        if hasattr(param, "summed_grad"):
            del param.summed_grad


_ACTIVE: contextvars.ContextVar[DpSgd | None] = contextvars.ContextVar("edgepfl_dp_sgd", default=None)


def active_dp_sgd() -> DpSgd | None:
    """The DP-SGD `run_epochs` trains with now, or None (plain SGD)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def dp_sgd(trainer: DpSgd | None) -> Iterator[DpSgd | None]:
    """Within the block, `run_epochs` trains with `trainer`'s DP-SGD (None: as it would without)."""
    token = _ACTIVE.set(trainer)
    try:
        yield trainer
    finally:
        _ACTIVE.reset(token)
