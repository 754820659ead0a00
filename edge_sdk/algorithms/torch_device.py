"""The plumbing every PyTorch device algorithm shares, and nothing of any algorithm's behaviour.

`TorchDevice` builds the device's network from the model factory (the run's `settings.model`,
or the factory the device was given) after checking the capabilities the algorithm needs,
places the network and the data on the accelerator, partitions the state into what travels
and what stays (by part name), loads and returns the shared arrays, keeps the personal state,
and hands out seeded generators. An algorithm module subclasses it and writes only its own
mathematics: what it trains, on which loss, and what goes up.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import ClassVar

import numpy as np
import torch
from torch.nn.modules.batchnorm import _BatchNorm

from ..models import ModelSpec, PartedNet, build_model, check_capabilities, statistics_keys
from ..models.capabilities import COMMON
from ..params import ArraySpec, Partition, check_arrays, partition_by_parts, spec_of
from ..protocol import ArrayGroup
from ..training import (accuracy, eval_mode, load_arrays, pick_device, place, recalibrate_batchnorm, state_arrays,
                        to_device)
from .base import DeviceAlgorithm, Task

SHARED = "shared"
"""The group name of the shared parameters, down (global) and up (local update)."""


def model_partition(model: torch.nn.Module, shared_parts: tuple[str, ...], share_statistics: bool = False,
                    share_batchnorm: bool = True) -> Partition:
    """Shared parts' keys are shared; BatchNorm running statistics only with `share_statistics`,
    and nothing of a BatchNorm layer (weight, bias, statistics) without `share_batchnorm` (FedBN)."""
    kept = set() if share_statistics else statistics_keys(model)
    if not share_batchnorm:
        kept |= batchnorm_keys(model)
    return partition_by_parts(model.state_dict().keys(), shared_parts, kept)


def batchnorm_keys(model: torch.nn.Module) -> set[str]:
    """The `state_dict` keys of every BatchNorm layer (found by module type, as `statistics_keys`)."""
    return {f"{prefix}.{key}" if prefix else key for prefix, sub in model.named_modules()
            if isinstance(sub, _BatchNorm) for key in sub.state_dict()}


class TorchDevice(DeviceAlgorithm):
    """A device algorithm on one PyTorch network whose `shared_parts` travel and whose other
    parts (and BatchNorm statistics, unless `share_statistics`; whole BatchNorm layers, unless
    `share_batchnorm`) stay on the device."""

    requires = COMMON
    shared_parts: ClassVar[tuple[str, ...]] = ("body", "head")
    share_statistics: ClassVar[bool] = False
    share_batchnorm: ClassVar[bool] = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.device = pick_device(self.device_name)
        base = self.base_model()
        check_capabilities(type(self), base)
        self.model = place(self.build_network(base), self.device)
        self.partition = model_partition(self.model, self.shared_parts, self.share_statistics, self.share_batchnorm)
        self.shared_spec = spec_of(state_arrays(self.model, self.partition.shared))
        self.train_x = to_device(self.data.train_x, self.device)
        self.train_y = to_device(self.data.train_y, self.device)
        self.test_x, self.test_y = to_device(self.data.test_x, self.device), to_device(self.data.test_y, self.device)

    def network_spec(self) -> ModelSpec:
        """The model this device builds: the run's (or the factory the device was given)."""
        return self.model_spec

    def base_model(self) -> PartedNet:
        """The model factory's network for the task from the run's seed: the same weights on
        every device and on the coordinator."""
        return build_model(self.network_spec(), self.data.task, seed=self.settings.seed)

    def build_network(self, base: PartedNet) -> torch.nn.Module:
        """The device's network made from `base` (the factory's model, capabilities checked);
        its top-level children are the parts `shared_parts` names. By default `base` as it
        is; algorithms that add or replace parts override this."""
        return base

    # -- the local optimizer ---------------------------------------------------------------
    def local_optimizer(self, params: Iterable[torch.nn.Parameter],
                        own: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]) -> torch.optim.Optimizer:
        """The optimizer of one local training phase over `params`, the one place that decides:
        with the run's `optimizer = "sgd"`, SGD at the run's `lr`, `sgd_momentum` and
        `sgd_weight_decay` for every algorithm and phase alike (methods compared under one
        optimizer); otherwise `own(params)`, the algorithm's own (its paper's) optimizer."""
        params = list(params)
        settings = self.settings
        if settings.optimizer == "sgd":
            return torch.optim.SGD(params, lr=settings.lr, momentum=settings.sgd_momentum,
                                   weight_decay=settings.sgd_weight_decay)
        return own(params)

    # -- what travels ----------------------------------------------------------------------
    def load_shared(self, task: Task, model: torch.nn.Module | None = None) -> None:
        """Load the round's shared arrays (if any came down) into `model` (default: the device's)
        after checking them exactly."""
        if SHARED in task.groups:
            check_arrays(SHARED, task.groups[SHARED], self.shared_spec)
            load_arrays(self.model if model is None else model, task.groups[SHARED])

    def shared_state(self) -> ArrayGroup:
        return state_arrays(self.model, self.partition.shared)

    def body_statistics(self, task: Task) -> ArrayGroup:
        """The global body's BatchNorm statistics on this device's training split (`body.*`
        keys), recomputed on a copy so that the device's own statistics stay as they are."""
        if "body" not in self.shared_parts:
            return {}
        self.load_shared(task)
        body = copy.deepcopy(self.model.get_submodule("body"))
        recalibrate_batchnorm(body, self.train_x)
        return {f"body.{key}": value for key, value in state_arrays(body, sorted(statistics_keys(body))).items()}

    def class_values(self, task: Task, group: str, spec: ArraySpec) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A per-class group that came down, checked against `spec` (its values [C, d], then its
        mask [C] of the classes that have one): both on the device, or None when the group did not
        come or no class has a value yet (DC-PFL's global means, FedProto's global prototypes)."""
        arrays = task.groups.get(group)
        if arrays is None:
            return None
        check_arrays(group, arrays, spec)
        values, mask = (np.array(arrays[key]) for key in spec)
        if not mask.any():
            return None
        return to_device(values, self.device), to_device(mask, self.device)

    # -- what stays ------------------------------------------------------------------------
    def personal_state(self) -> ArrayGroup:
        return state_arrays(self.model, self.partition.personal)

    def load_personal_state(self, arrays: ArrayGroup) -> None:
        check_arrays("personal", arrays, spec_of(self.personal_state()))
        load_arrays(self.model, arrays)

    # -- reproducibility and scoring -------------------------------------------------------
    def generator(self, round_: int) -> torch.Generator:
        """The device's generator for round `round_` (batch order, augmentations)."""
        return torch.Generator().manual_seed(self.client_seed * 100_003 + round_)

    def test_accuracy(self, model: torch.nn.Module) -> float:
        """Accuracy of `model` (in evaluation mode) on the device's test split."""
        with eval_mode(model):
            return accuracy(model, self.test_x, self.test_y)
