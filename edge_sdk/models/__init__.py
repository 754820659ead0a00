"""Models: factories, the body/head split, and the helpers algorithms use on named parts.

A model comes from a factory `factory(task) -> nn.Module` (`registry`): a built-in name, an
import path, an entry point or a callable. `build_model` turns what the factory returns into a
`PartedNet` whose top-level children are the parts `body` (features) and `head` (classifier),
with seeded weights. Algorithms partition `state_dict` keys by part, and treat BatchNorm running
statistics (found by module type with `statistics_keys`) as personal.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..data.task import TaskSpec
from .capabilities import Capability, ModelCapabilityError, check_capabilities
from .parted import ModelError, PartedNet, as_parted, feature_dim_of, split
from .registry import (
    BUILTINS,
    ENTRY_POINT_GROUP,
    MODEL_NAMES,
    BuiltinModel,
    ModelFactory,
    ModelSpec,
    default_model_for,
    describe,
    model_name,
    resolve_factory,
)
from .signature import Signature, first_mismatch, model_signature, signature_from_plain, signature_to_plain

__all__ = [
    "BUILTINS",
    "ENTRY_POINT_GROUP",
    "MODEL_NAMES",
    "Capability",
    "ModelCapabilityError",
    "ModelError",
    "ModelFactory",
    "ModelSpec",
    "PartedNet",
    "Signature",
    "build_body",
    "build_model",
    "check_capabilities",
    "count_parameters",
    "describe",
    "default_model_for",
    "first_mismatch",
    "model_name",
    "model_signature",
    "part_keys",
    "resolve_factory",
    "seeded_init",
    "signature_from_plain",
    "signature_to_plain",
    "split",
    "state_nbytes",
    "statistics_keys",
]

logger = logging.getLogger(__name__)

_STATISTIC_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")

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


def _seeded(seed: int | None) -> AbstractContextManager:
    return seeded_init(seed) if seed is not None else nullcontext()


def build_model(spec: ModelSpec, task: TaskSpec, *, seed: int | None = None) -> PartedNet:
    """The model `spec` names for `task`, as a `PartedNet` with its measured `feature_dim`.

    With `seed`, initialization is deterministic (the coordinator and every device start from the
    same weights): `seeded_init`. Raises ModelError for a spec that does not resolve, a module
    without a body/head split, or a body whose output is not [B, D].
    """
    where = describe(spec)
    factory = resolve_factory(spec, task)
    with _seeded(seed):
        module = factory(task)
    if not isinstance(module, nn.Module):
        raise ModelError(f"model {where}: the factory returned a {type(module).__name__}, not an nn.Module")
    model = as_parted(module, where)
    model.feature_dim = feature_dim_of(model.body, task, where)
    logger.debug("built %s: %d parameters, seed %s", where, count_parameters(model), seed)
    return model


def build_body(spec: ModelSpec, task: TaskSpec, *, seed: int | None = None) -> tuple[nn.Module, int]:
    """The feature extractor of model `spec` for `task`, and its feature dimension.

    A built-in model builds its body alone (no head is drawn from the random state, so an
    algorithm that adds its own parts after the body, inside its own `seeded_init`, gets the same
    weights as ever); any other factory builds the whole model and gives its body.
    """
    factory = resolve_factory(spec, task)
    if isinstance(factory, BuiltinModel):
        with _seeded(seed):
            return factory.body(task)
    model = build_model(factory, task, seed=seed)
    assert model.feature_dim is not None  # build_model measured it
    return model.body, model.feature_dim


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
