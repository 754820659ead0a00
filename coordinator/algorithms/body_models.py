"""Devices of different models (`body_models`), for the servers that hold class statistics and
never a body (DC-PFL, FedProto): the bodies may differ as long as their features have the run's
dimension. The models are checked once, at start, against the algorithm's capabilities and that
dimension, and handed out round-robin in registration order."""

from __future__ import annotations

from typing import TYPE_CHECKING

from edge_sdk.models import build_body, build_model, check_capabilities, describe

if TYPE_CHECKING:
    from edge_sdk.algorithms.base import DeviceAlgorithm

    from .base import ServerContext


class BodyModels:
    """The run's feature dimension (`dim`) and the model each device is assigned (`assignment`)."""

    def __init__(self, names: list[str], device: type[DeviceAlgorithm], context: ServerContext):
        task = context.task
        self.dim = build_body(context.model, task)[1]
        for name in names:
            model = build_model(name, task)
            check_capabilities(device, model)
            if model.feature_dim != self.dim:
                raise ValueError(f"body_models: {name} has feature dimension {model.feature_dim}, the run's "
                                 f"model {describe(context.model)} {self.dim}")
        self.names = names
        self._registration: dict[str, int] = {}

    def assignment(self, client_id: str) -> dict[str, str]:
        """The model `client_id` runs: the next of `names` in registration order (none: the run's)."""
        if not self.names:
            return {}
        index = self._registration.setdefault(client_id, len(self._registration))
        return {"model": self.names[index % len(self.names)]}
