"""Model registry and the helpers federated algorithms use to split a model into named parts.

Every model is a `PartedNet` whose top-level children are the parts `body` (features) and `head`
(classifier). Algorithms partition `state_dict` keys by part, and treat BatchNorm running
statistics (found by module type with `statistics_keys`) as personal.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from edge_sdk.models.cnn import cnn8, cnn8_wide, cnn28, cnn32
from edge_sdk.models.torchvision_models import mobilenet_v3_small_body, resnet18_body

__all__ = [
    "MODEL_NAMES",
    "PartedNet",
    "build_body",
    "build_model",
    "count_parameters",
    "default_model_for",
    "part_keys",
    "seeded_init",
    "state_nbytes",
    "statistics_keys",
]

logger = logging.getLogger(__name__)

_BodyBuilder = Callable[[int, int], tuple[nn.Module, int]]
"""(in_channels, image_size) -> (body, feature_dim)."""

# name -> (builder, the image sizes it accepts; None when any size works)
_REGISTRY: dict[str, tuple[_BodyBuilder, tuple[int, ...] | None]] = {
    "cnn8": (lambda c, s: cnn8(c), (8,)),
    "cnn8_wide": (lambda c, s: cnn8_wide(c), (8,)),
    "cnn28": (lambda c, s: cnn28(c), (28,)),
    "cnn32": (lambda c, s: cnn32(c), (32,)),
    "resnet18": (lambda c, s: resnet18_body(c), None),
    "mobilenet_v3_small": (mobilenet_v3_small_body, None),
}

MODEL_NAMES: tuple[str, ...] = tuple(_REGISTRY)

_DEFAULT_FOR_SIZE = {8: "cnn8", 28: "cnn28", 32: "cnn32"}

_STATISTIC_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def build_body(name: str, *, in_channels: int, image_size: int) -> tuple[nn.Module, int]:
    """Build the feature extractor `name` for [B, in_channels, image_size, image_size] inputs.

    Returns `(body, feature_dim)`. Raises ValueError for an unknown name or an image size the
    model cannot take, so a misconfigured run fails before training starts.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODEL_NAMES)}")
    if in_channels < 1 or image_size < 1:
        raise ValueError(f"in_channels and image_size must be positive, got {in_channels}, {image_size}")
    builder, sizes = _REGISTRY[name]
    if sizes is not None and image_size not in sizes:
        allowed = ", ".join(f"{s}x{s}" for s in sizes)
        raise ValueError(f"model {name!r} takes images of size {allowed}, not {image_size}x{image_size}")
    return builder(in_channels, image_size)


class PartedNet(nn.Module):
    """A classifier made of named parts: `body` (features) then `head` (linear classifier).

    The attribute names are the part names that prefix the `state_dict` keys (`body.*`, `head.*`).
    """

    def __init__(self, body: nn.Module, head: nn.Module, feature_dim: int) -> None:
        super().__init__()
        self.body = body
        self.head = head
        self.feature_dim = feature_dim

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Map inputs [B, C, H, W] to features [B, feature_dim]."""
        return self.body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map inputs [B, C, H, W] to logits [B, num_classes]."""
        return self.head(self.body(x))


_SEEDED_INIT = threading.RLock()
"""Serializes seeded initializations: torch's global RNG is one per process, so two threads
seeding and drawing from it at once (devices run as threads of one process) would interleave
their draws and build different weights."""


@contextmanager
def seeded_init(seed: int) -> Iterator[None]:
    """Initialize modules from `seed` inside the block: the same weights in every thread and
    process for the same seed, and the caller's global random state left untouched."""
    with _SEEDED_INIT, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def build_model(
    name: str, *, in_channels: int, num_classes: int, image_size: int, seed: int | None = None
) -> PartedNet:
    """Build model `name` with a linear head for `num_classes`.

    With `seed`, initialization is deterministic (every client can start from the same weights):
    `seeded_init`.
    """
    if num_classes < 1:
        raise ValueError(f"num_classes must be positive, got {num_classes}")

    def make() -> PartedNet:
        body, feature_dim = build_body(name, in_channels=in_channels, image_size=image_size)
        return PartedNet(body, nn.Linear(feature_dim, num_classes), feature_dim)

    if seed is None:
        model = make()
    else:
        with seeded_init(seed):
            model = make()
    logger.debug("built %s: %d parameters, seed %s", name, count_parameters(model), seed)
    return model


def default_model_for(image_size: int) -> str:
    """The small CNN suited to square images of `image_size` pixels (8, 28 or 32)."""
    try:
        return _DEFAULT_FOR_SIZE[image_size]
    except KeyError:
        sizes = ", ".join(str(s) for s in _DEFAULT_FOR_SIZE)
        raise ValueError(f"no default model for image size {image_size}; sizes with one: {sizes}") from None


def statistics_keys(module: nn.Module) -> set[str]:
    """The `state_dict` keys of every BatchNorm layer's running statistics.

    Found by module type (`_BatchNorm`), not by key substring, so a buffer that merely has a
    similar name elsewhere is not mistaken for a statistic.
    """
    state_keys = set(module.state_dict().keys())
    keys: set[str] = set()
    for prefix, sub in module.named_modules():
        if not isinstance(sub, _BatchNorm):
            continue
        for buffer_name in _STATISTIC_BUFFERS:
            key = f"{prefix}.{buffer_name}" if prefix else buffer_name
            if key in state_keys:  # absent when track_running_stats=False
                keys.add(key)
    return keys


def part_keys(module: nn.Module) -> dict[str, list[str]]:
    """Map each top-level child name (part) to its `state_dict` keys, in `state_dict` order.

    Raises ValueError for state that belongs to no child (a parameter on the root module), since
    such state would be silently left out of every part.
    """
    parts: dict[str, list[str]] = {name: [] for name, _ in module.named_children()}
    for key in module.state_dict():
        part = key.split(".", 1)[0]
        if part not in parts:
            raise ValueError(f"state_dict key {key!r} belongs to no top-level child")
        parts[part].append(key)
    return parts


def count_parameters(module: nn.Module) -> int:
    """Total number of parameter elements (trainable or not)."""
    return sum(p.numel() for p in module.parameters())


def state_nbytes(module: nn.Module) -> int:
    """Bytes of the `state_dict` with floating tensors counted as float32 (their size on the wire).

    Non-floating buffers (e.g. `num_batches_tracked`) count at their own element size.
    """
    return sum(
        t.numel() * (4 if t.is_floating_point() else t.element_size())
        for t in module.state_dict().values()
    )
