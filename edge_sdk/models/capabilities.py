"""What an algorithm needs of a model, checked before anything trains.

Each algorithm class lists the capabilities it needs (`requires`); `check_capabilities` runs
on the device and on the coordinator at start, so a model an algorithm cannot use is refused
with the algorithm's name and the missing capability, never by a failure inside a round.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .parted import ModelError


CHANNEL_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, _BatchNorm, nn.GroupNorm, nn.LayerNorm,
                  nn.modules.instancenorm._InstanceNorm)
"""Layers whose every parameter has the output channels along its first axis."""


class ModelCapabilityError(ModelError):
    """An algorithm cannot run with this model: the message names both and what is missing."""


@dataclass(frozen=True)
class Capability:
    """A named property of a model; `missing(model)` says why a model lacks it (None: it has it)."""

    name: str
    description: str
    missing: Callable[[nn.Module], str | None]


def _missing_parts(model: nn.Module) -> str | None:
    children = dict(model.named_children())
    if "body" not in children or "head" not in children:
        return f"the model ({type(model).__name__}) has no `body` and `head` parts"
    return None


def _missing_flat_features(model: nn.Module) -> str | None:
    dim = getattr(model, "feature_dim", None)
    return None if isinstance(dim, int) and dim > 0 else "the body's output is not a flat feature vector [B, D]"


def _missing_linear_head(model: nn.Module) -> str | None:
    head = getattr(model, "head", None)
    if not isinstance(head, nn.Linear):
        return f"the head is a {type(head).__name__}, not a single nn.Linear on the features"
    if head.in_features != getattr(model, "feature_dim", None):
        return f"the head takes {head.in_features} inputs, the body gives {getattr(model, 'feature_dim', None)}"
    return None


def _missing_channel_structure(model: nn.Module) -> str | None:
    for name, module in model.get_submodule("body").named_modules():
        if next(module.parameters(recurse=False), None) is not None and not isinstance(module, CHANNEL_LAYERS):
            return f"body.{name} is a {type(module).__name__}"
    return None


PARTS = Capability("parts", "a body/head split", _missing_parts)
FLAT_FEATURES = Capability("flat_features", "a flat feature vector [B, D] from the body", _missing_flat_features)
LINEAR_HEAD = Capability("linear_head", "a single nn.Linear head on the features", _missing_linear_head)
CHANNEL_STRUCTURE = Capability(
    "channel_structure",
    "a body of channel-structured layers (Conv, Linear and normalization layers only)",
    _missing_channel_structure,
)
TWO_EXTRACTORS = Capability(
    "two_extractors",
    "two feature extractors of the same structure (the factory builds the second)",
    _missing_flat_features,
)
PROJECTOR = Capability("projector", "a projector built on the feature dimension", _missing_flat_features)

COMMON: tuple[Capability, ...] = (PARTS, FLAT_FEATURES)
"""What every algorithm needs."""


class NeedsCapabilities(Protocol):
    """What `check_capabilities` reads of an algorithm: its id and what it requires of a model
    (a device algorithm's class; typed here, not imported, so models never import algorithms)."""

    id: ClassVar[str]
    requires: ClassVar[tuple[Capability, ...]]


def check_capabilities(algorithm_cls: type[NeedsCapabilities], model: nn.Module) -> None:
    """Raise ModelCapabilityError for the first capability in `algorithm_cls.requires` that
    `model` (a built model with parts and `feature_dim`) lacks."""
    for capability in algorithm_cls.requires:
        reason = capability.missing(model)
        if reason is not None:
            raise ModelCapabilityError(f"{algorithm_cls.id} needs {capability.description}; {reason}")
