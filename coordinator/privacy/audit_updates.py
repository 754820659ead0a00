"""What the audit's non-canary devices upload: their change from the round's global arrays.

The other devices are what the canaries hide among: their changes project onto a canary's
direction and blur its score. Two sources. `RandomUpdates`: each device's change is a fresh
Gaussian direction of norm twice the clip bound (so the mechanism's clipping acts on every one),
cheap on any model size; in d dimensions its projection on a canary is about its norm / sqrt(d),
as a real update's would be were it unrelated to the canary. `TrainedUpdates`: each device trains
the model for real on its part of a built-in dataset (one local epoch of SGD from the round's
global arrays), for a fleet whose updates share directions the way trained ones do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

import numpy as np

from edge_sdk.protocol import ArrayGroup


class UpdateSource(Protocol):
    """The change device `index` (0-based among the non-canary devices) uploads in round `round_`."""

    def change(self, index: int, reference: ArrayGroup, round_: int) -> dict[str, np.ndarray]: ...


def floating_keys(arrays: Mapping[str, np.ndarray]) -> list[str]:
    """The keys of the floating arrays, the ones the DP mechanism clips and noises."""
    return [key for key, value in arrays.items() if np.asarray(value).dtype.kind == "f"]


class RandomUpdates:
    """Gaussian changes of norm `norm` over the floating arrays of the reference, from `seed`."""

    def __init__(self, norm: float, seed: int):
        self.norm, self.seed = norm, seed

    def change(self, index: int, reference: ArrayGroup, round_: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, 3, round_, index])
        drawn = {key: rng.standard_normal(np.shape(reference[key])) for key in floating_keys(reference)}
        total = math.sqrt(sum(float(np.vdot(v, v)) for v in drawn.values()))
        return {key: value * (self.norm / total) for key, value in drawn.items()}


def initial_arrays(model: str, dataset: str, seed: int) -> ArrayGroup:
    """The initial arrays (every state entry) of `model` built for built-in task `dataset` from
    `seed`, as a run starts it: the audit's first reference."""
    from edge_sdk.data.resolve import resolve_task
    from edge_sdk.models import build_model

    return _arrays(build_model(model, resolve_task(dataset), seed=seed))


def _arrays(module) -> ArrayGroup:
    return {key: value.detach().cpu().numpy().copy() for key, value in module.state_dict().items()}


class TrainedUpdates:
    """Real local training: device `index` of `devices` trains `model` on its part of built-in
    `dataset` (iid) for one epoch of SGD at `lr`, batch `batch_size`, from the round's arrays."""

    def __init__(self, model: str, dataset: str, devices: int, seed: int, *, lr: float = 0.05, batch_size: int = 32):
        import torch

        from edge_sdk.data import partition_client_data
        from edge_sdk.data.datasets import load_dataset
        from edge_sdk.data.resolve import resolve_task
        from edge_sdk.models import build_model

        self.module = build_model(model, resolve_task(dataset), seed=seed)
        self.devices, self.seed, self.batch_size = devices, seed, batch_size
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=lr)  # no momentum: no state across devices
        self._data: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pool = load_dataset(dataset)
        self._partition = partition_client_data

    def initial(self) -> ArrayGroup:
        """The model's initial arrays (every state entry), the run's first reference."""
        return _arrays(self.module)

    def _examples(self, index: int):
        import torch

        if index not in self._data:
            data = self._partition(self._pool, num_clients=self.devices, index=index, seed=self.seed)
            self._data[index] = (torch.as_tensor(data.train_x), torch.as_tensor(data.train_y, dtype=torch.long))
        return self._data[index]

    def change(self, index: int, reference: ArrayGroup, round_: int) -> dict[str, np.ndarray]:
        import torch
        from torch.nn import functional

        from edge_sdk.training import load_arrays, run_epochs, state_arrays

        load_arrays(self.module, dict(reference))
        x, y = self._examples(index)
        seed = int(np.random.SeedSequence([self.seed, round_, index]).generate_state(1)[0])
        generator = torch.Generator().manual_seed(seed)
        self.module.train()
        run_epochs(lambda xb, yb: functional.cross_entropy(self.module(xb), yb), self.optimizer, x, y, epochs=1,
                   batch_size=self.batch_size, generator=generator, module=self.module)
        keys = floating_keys(reference)
        trained = state_arrays(self.module, keys)
        return {key: trained[key].astype(np.float64) - np.asarray(reference[key], dtype=np.float64) for key in keys}
