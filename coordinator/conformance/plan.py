"""The run the kit plays: FedAvg on the built-in task the device declares, with a small model.

Everything comes from the coordinator's own code: the run configuration (`RunConfig`), the
server algorithm (initial state, what TRAIN and EVALUATE carry, the update spec), the WELCOME
settings and model signature, and the reply checks (`validation.checked_update`), so a device
that passes the kit is accepted by a real coordinator for the same reasons.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edge_sdk.data import BUILTIN_TASKS
from edge_sdk.models import build_model, model_signature, signature_to_plain
from edge_sdk.protocol import ArrayGroup, Envelope

from .. import algorithms
from ..aggregation.validation import UpdateLimits, checked_update
from ..algorithms.base import ServerAlgorithm, ServerContext
from ..config.run_config import RunConfig

ALGORITHM = "fedavg"


class PlanError(ValueError):
    """The device declares a task the kit cannot play (not a built-in one)."""


@dataclass
class Plan:
    """One FedAvg run for one device: its configuration, server algorithm and model signature."""

    config: RunConfig
    algorithm: ServerAlgorithm
    signature: list[list]

    @classmethod
    def for_task(cls, task: str, *, model: str = "auto", seed: int = 0, batch_size: int = 32) -> Plan:
        if task not in BUILTIN_TASKS:
            raise PlanError(f"the device's task {task!r} is not a built-in one ({', '.join(BUILTIN_TASKS)}): "
                            "give --dataset")
        config = RunConfig.of(algorithm=ALGORITHM, dataset=task, model=model, rounds=2, local_epochs=1,
                              batch_size=batch_size, seed=seed, clients=1, min_clients=1)
        context = ServerContext(config.model_name, config.task(), seed, config.training.rounds, 1, config.aggregation)
        algorithm = algorithms.load(ALGORITHM)(algorithms.hyperparameters(ALGORITHM, {}), context)
        signature = signature_to_plain(model_signature(build_model(config.model_name, config.task())))
        return cls(config, algorithm, signature)

    @property
    def num_classes(self) -> int:
        return self.config.task().num_classes

    def welcome(self, incarnation: str, codec: str) -> dict[str, Any]:
        """A WELCOME's config (docs/PROTOCOL.md section 7) for a run with upload codec `codec`."""
        settings = {**self.config.welcome_settings(), "upload_codec": codec}
        return {"incarnation": incarnation, "algorithm": ALGORITHM, "hyper": {}, "assignment": {},
                "settings": settings, "model_signature": self.signature}

    def train_groups(self, round_: int) -> dict[str, ArrayGroup]:
        return self.algorithm.task_groups(round_)

    def eval_groups(self) -> dict[str, ArrayGroup]:
        return self.algorithm.eval_groups()

    def check_update(self, reply: Envelope, request: Envelope, registered_examples: int, codec: str) -> float:
        """The coordinator's checks of a TRAIN_RES against the TRAIN it answers; returns its
        weight, raises ValidationError naming the reason code."""
        limits = UpdateLimits(self.config.round.max_examples, self.config.round.max_update_norm)
        _, weight = checked_update(self.algorithm, request.round, reply, request.groups, registered_examples, limits,
                                   codec)
        return weight

