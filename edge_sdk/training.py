"""Torch loops every device algorithm shares: batching, an epoch of training, accuracy.

Data arrive as numpy arrays; they are moved to the device once per call and batched by index
with a seeded permutation, so runs are reproducible. On CUDA the host tensors are pinned and
copied without blocking.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .privacy.dpsgd import active_dp_sgd


def pick_device(requested: str = "auto") -> torch.device:
    """`auto` picks CUDA, then Apple MPS, then CPU; anything else is passed to torch.device."""
    if requested != "auto":
        device = torch.device(requested)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {requested} asked for CUDA, but torch sees no CUDA device")
        return device
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


ModuleT = TypeVar("ModuleT", bound=nn.Module)


def place(module: ModuleT, device: torch.device) -> ModuleT:
    """Move `module` to `device`; a module with 2-D convolutions also goes to the channels-last
    (NHWC) memory format, which oneDNN on CPUs and cuDNN's tensor-core kernels run fastest: one
    epoch of cnn28 at batch 32 on one CPU core went from about 2,300 to 4,600 images/s, most of
    it max-pooling, which is slow on NCHW maps. The values are the same; inputs need no
    conversion (a convolution with channels-last weights gives channels-last outputs)."""
    module = module.to(device)
    if any(isinstance(m, nn.Conv2d) for m in module.modules()):
        module = module.to(memory_format=torch.channels_last)
    return module


def to_device(x: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(x))
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def batches(
    n: int, batch_size: int, *, shuffle: bool, generator: torch.Generator | None = None
) -> Iterator[torch.Tensor]:
    """Index tensors covering range(n) in batches; a last batch of one is folded into the previous
    batch so BatchNorm never sees a single example in training."""
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    starts = list(range(0, n, batch_size))
    if len(starts) > 1 and n - starts[-1] == 1:
        starts.pop()
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else n
        yield order[start:end]


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(inputs batch, labels batch) -> scalar loss."""


def run_epochs(
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    generator: torch.Generator,
    module: nn.Module | None = None,
) -> float:
    """Minimize `loss_fn` over (x, y) for `epochs`; returns the mean loss of the last epoch.

    Inside `mixed_precision(True)` on a CUDA device the forward pass runs under autocast (fp16)
    with a gradient scaler; inside `gradient_clipping(c)` each step's gradients are scaled to an
    L2 norm of at most c first. The loss is summed on the device and read once per epoch, so the
    loop does not synchronize with the GPU at every batch. Inside `privacy.dpsgd.dp_sgd(...)` the
    epochs are DP-SGD steps instead (Poisson batches, per-example clipping, noise; full precision),
    which need `module`, the network `loss_fn` runs.
    """
    private = active_dp_sgd()
    if private is not None:
        return private.run_epochs(loss_fn, optimizer, x, y, epochs=epochs, batch_size=batch_size,
                                  generator=generator, module=module, max_norm=_GRAD_CLIP.get())
    amp = _AMP.get() and x.device.type == "cuda"
    scaler = torch.amp.GradScaler("cuda") if amp else None
    max_norm = _GRAD_CLIP.get()
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    mean_loss = float("nan")
    for _ in range(epochs):
        total, count = torch.zeros((), device=x.device), 0
        for idx in batches(len(y), batch_size, shuffle=True, generator=generator):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
                loss = loss_fn(x[idx], y[idx])
            if scaler is not None:
                scaler.scale(loss).backward()
                if max_norm > 0:
                    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                    nn.utils.clip_grad_norm_(parameters, max_norm)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if max_norm > 0:
                    nn.utils.clip_grad_norm_(parameters, max_norm)
                optimizer.step()
            total += loss.detach().float() * len(idx)
            count += len(idx)
        mean_loss = float(total) / max(count, 1)
    return mean_loss


_AMP: contextvars.ContextVar[bool] = contextvars.ContextVar("edgepfl_amp", default=False)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Within the block torch and numpy's BLAS compute on one thread: float reductions then run in
    one order whatever the machine's cores or OMP_NUM_THREADS, so results repeat bit for bit."""
    from threadpoolctl import threadpool_limits

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threadpool_limits(1):
            yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def mixed_precision(enabled: bool):
    """Within the block, `run_epochs` on CUDA uses automatic mixed precision (a device-local
    choice: the same run may have AMP on a GPU device and full precision elsewhere)."""
    token = _AMP.set(enabled)
    try:
        yield
    finally:
        _AMP.reset(token)


_GRAD_CLIP: contextvars.ContextVar[float] = contextvars.ContextVar("edgepfl_grad_clip", default=0.0)


@contextlib.contextmanager
def gradient_clipping(max_norm: float):
    """Within the block, `run_epochs` scales each step's gradients (all of the optimizer's
    parameters together) to an L2 norm of at most `max_norm`; 0 leaves them alone. The run's
    `grad_clip_norm`: one batch whose gradient explodes then moves the weights by at most lr x
    max_norm (times the momentum's gain) instead of to infinity."""
    token = _GRAD_CLIP.set(max_norm)
    try:
        yield
    finally:
        _GRAD_CLIP.reset(token)


@torch.no_grad()
def predict(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
    """Scores of `forward` over x in batches (evaluation mode is the caller's job)."""
    outputs = [forward(x[idx]) for idx in batches(len(x), batch_size, shuffle=False)]
    return torch.cat(outputs) if outputs else torch.empty(0)


def accuracy(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> float:
    if len(y) == 0:
        return float("nan")
    return float((predict(forward, x).argmax(dim=1) == y).float().mean())


@torch.no_grad()
def recalibrate_batchnorm(module: nn.Module, x: torch.Tensor) -> None:
    """Recompute every BatchNorm layer's running statistics as the average over `x` (no training)."""
    layers = [m for m in module.modules() if isinstance(m, _BatchNorm)]
    if not layers or len(x) < 2:
        return
    momenta = [layer.momentum for layer in layers]
    was_training = module.training
    for layer in layers:
        layer.reset_running_stats()
        layer.momentum = None  # cumulative average over the batches
    module.train()
    for idx in batches(len(x), 512, shuffle=False):
        module(x[idx])
    for layer, momentum in zip(layers, momenta, strict=True):
        layer.momentum = momentum
    module.train(was_training)


def state_arrays(module: nn.Module, keys: tuple[str, ...] | list[str]) -> dict[str, np.ndarray]:
    """Copies of the named state entries as numpy arrays (on the host)."""
    state = module.state_dict()
    return {k: state[k].detach().cpu().numpy().copy() for k in keys}


def load_arrays(module: nn.Module, arrays: dict[str, np.ndarray]) -> None:
    """Load named arrays into a module's state without touching the entries not named."""
    state = module.state_dict()
    with torch.no_grad():
        for key, value in arrays.items():
            state[key].copy_(torch.as_tensor(np.array(value), device=state[key].device))


def eval_mode(module: nn.Module) -> _EvalMode:
    return _EvalMode(module)


class _EvalMode:
    """Context manager: evaluation mode inside, the previous mode restored after."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __enter__(self) -> nn.Module:
        self.was_training = self.module.training
        self.module.eval()
        return self.module

    def __exit__(self, *exc: object) -> None:
        self.module.train(self.was_training)


def cross_entropy_loss(model: nn.Module) -> LossFn:
    criterion = nn.CrossEntropyLoss()
    return lambda xb, yb: criterion(model(xb), yb)
