"""Server side of the FedAvg family: weighted average of the shared parts, by name.

A pure part-sharing algorithm has no server module of its own: the registry
(`coordinator.algorithms.load`) derives its server from its device class with `server_for`.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from edge_sdk.algorithms.base import DeviceAlgorithm
from edge_sdk.algorithms.torch_device import SHARED, TorchDevice, model_partition
from edge_sdk.models import build_model
from edge_sdk.params import ArraySpec, spec_of
from edge_sdk.protocol import ArrayGroup
from edge_sdk.training import state_arrays

from ..aggregation.averaging import PartialSum, WeightedMean, accumulator_dtype
from ..privacy.policy import PARAMETERS
from .base import ServerAlgorithm


class PartSharingServer(ServerAlgorithm):
    """Holds the shared parts of the model; averages uploads weighted by examples.

    `device` names the device-side class, whose `shared_parts` both sides use, so the partition
    is written once. The mean is a sum of per-update terms, so shard aggregators can each sum
    their devices' weighted changes (`partial`) and the coordinator add the sums up
    (`fold_partial`): with the mean rule, optionally clipped (each update is clipped where it is
    summed, as it would be at the coordinator).
    """

    device: ClassVar[type[TorchDevice]]
    unshardable = None
    asynchronous: ClassVar[str | None] = None

    def initial_state(self) -> dict[str, ArrayGroup]:
        model = build_model(self.context.model, self.context.task, seed=self.context.seed)
        partition = model_partition(model, self.device.shared_parts, self.device.share_statistics,
                                    self.device.share_batchnorm)
        return {SHARED: state_arrays(model, partition.shared)}

    def update_spec(self, round_: int) -> dict[str, ArraySpec]:
        return {SHARED: spec_of(self.state[SHARED])}

    def upload_kinds(self) -> dict[str, str]:
        return {SHARED: PARAMETERS}

    def begin_round(self, round_: int) -> None:
        self._mean = self.new_aggregator(self.state[SHARED])

    def accumulate(self, client_id, groups, metrics, weight) -> None:
        self._mean.add(groups[SHARED], weight)

    def end_round(self, round_: int) -> None:
        self.state = {SHARED: self._mean.result()}

    def begin_partial(self, round_: int, sent: dict[str, ArrayGroup]) -> None:
        self.state = sent
        self.begin_round(round_)

    def partial(self) -> dict[str, PartialSum]:
        return {SHARED: self._weighted_mean().partial()}

    def partial_spec(self, round_: int) -> dict[str, ArraySpec]:
        least = np.dtype(self.context.aggregation.dtype)
        return {group: {key: (shape, accumulator_dtype(np.dtype(dtype), least).name) for key, (shape, dtype) in
                        arrays.items()} for group, arrays in self.update_spec(round_).items()}

    def fold_partial(self, round_: int, partial: dict[str, PartialSum]) -> None:
        dtypes = {key: np.dtype(dtype) for key, (_, dtype) in self.update_spec(round_)[SHARED].items()}
        self._weighted_mean().add_partial(partial[SHARED], dtypes)

    def _weighted_mean(self) -> WeightedMean:
        """The round's streaming mean, under the clipping wrapper if any."""
        mean = getattr(self._mean, "inner", self._mean)
        if not isinstance(mean, WeightedMean):
            raise TypeError(f"{self.id}: the {self.context.aggregation.rule} rule does not split into partial sums")
        return mean


def server_for(device: type[DeviceAlgorithm]) -> type[PartSharingServer]:
    """The server of a pure part-sharing algorithm: the example-weighted mean of its device
    class's `shared_parts`, with the device's id and hyperparameters."""
    if not issubclass(device, TorchDevice):
        raise TypeError(f"{device.id}: no server module, and its device class {device.__name__} shares no parts")
    name = device.__name__.removesuffix("Device") + "Server"
    return type(name, (PartSharingServer,), {"id": device.id, "device": device, "Hyper": device.Hyper,
                                             "__module__": __name__,
                                             "__doc__": f"{device.id}: {PartSharingServer.__doc__}"})
