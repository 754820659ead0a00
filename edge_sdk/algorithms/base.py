"""The device side of an algorithm: what every algorithm module in this package provides.

A device algorithm owns the device's model. The client hands it each round's task (the arrays
and config that came down) and sends back what `fit` returns. Whatever `personal_state`
returns is persisted on the device only and never leaves it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ..data import ClientData
from ..protocol import ArrayGroup
from ..settings import TrainSettings
from .hyper import NoHyper

if TYPE_CHECKING:  # torch stays out of this module's imports: the registry loads without it
    import torch
    from _typeshed import DataclassInstance

    from ..models import Capability, ModelSpec

OptimizerFactory = Callable[[Any, "TrainSettings"], "torch.optim.Optimizer"]
"""A trainer's own local optimizer: (parameters, the run's settings) -> optimizer."""
LossOverride = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]
"""A trainer's own loss: (logits, targets) -> scalar loss (e.g. label smoothing, class weights)."""


@dataclass
class Task:
    """One round's work as it came down: the round number, named arrays and config."""

    round: int
    groups: dict[str, ArrayGroup]
    config: dict[str, Any]


@dataclass
class FitResult:
    """What goes up after local training: named array groups and metrics (with num_examples)."""

    groups: dict[str, ArrayGroup]
    metrics: dict[str, float]


class TrainingStepRefused(ValueError):
    """A user optimizer or loss given to an algorithm whose local objective is its own."""


class DeviceAlgorithm(ABC):
    """One algorithm's device side. Subclasses set `id`, how the tables name and cite it
    (`display_name`, `citation`, `table_rank`, `paper_method`), the model capabilities they need
    (`requires`) and, if they have any, `Hyper`. `model` is a factory (or spec) that replaces
    the run's `settings.model` on this device; `optimizer` and `loss` replace the local training
    step's where the algorithm allows it (`accepts_training_step`)."""

    id: ClassVar[str]
    """The registry key: the module's name, the coordinator module's name, the config value."""
    display_name: ClassVar[str]
    """How tables, plots and docs name the algorithm ("FedAvg+FT")."""
    citation: ClassVar[str | None]
    """The short citation of the algorithm's paper in the measured tables ("Collins et al. 2021"; the
    five papers' methods are cited by their names), or None for a baseline without a paper (local
    training, FedAvg with fine-tuning)."""
    table_rank: ClassVar[int]
    """Position in every table and plot (colours follow it): ascending, unique, spaced by 10 so a
    new algorithm takes a free number between its neighbours."""
    paper_method: ClassVar[bool] = False
    """True for the five papers' methods this project reproduces (solid lines in plots, the
    ablations); False for the baselines."""
    Hyper: ClassVar[type[DataclassInstance]] = NoHyper
    requires: ClassVar[tuple[Capability, ...]] = ()
    accepts_training_step: ClassVar[bool] = False
    dp_sgd_refusal: ClassVar[str | None] = ("its local loss has not been shown to be a mean of per-example terms, "
                                            "which per-example clipping (DP-SGD) needs")
    """Why DP-SGD (`--dp-sgd`) cannot train this algorithm, or None when it can."""

    def __init__(
        self,
        hyper: Any,
        settings: TrainSettings,
        data: ClientData,
        device: str,
        client_seed: int,
        assignment: dict[str, Any] | None = None,
        *,
        model: ModelSpec | None = None,
        optimizer: OptimizerFactory | None = None,
        loss: LossOverride | None = None,
    ):
        if (optimizer is not None or loss is not None) and not self.accepts_training_step:
            raise TrainingStepRefused(f"{self.id} has its own local objective and optimizer: it takes no user "
                                      f"optimizer or loss (the FedAvg family does)")
        if optimizer is not None and settings.optimizer == "sgd":
            raise TrainingStepRefused("the run's optimizer = \"sgd\" gives every device one common optimizer: "
                                      "a trainer's own optimizer would break that; leave one of them out")
        self.hyper = hyper
        self.settings = settings
        self.data = data
        self.device_name = device
        self.client_seed = client_seed
        self.assignment = assignment or {}
        self.model_spec: ModelSpec = settings.model if model is None else model
        self.user_optimizer = optimizer
        self.user_loss = loss

    @abstractmethod
    def fit(self, task: Task) -> FitResult:
        """Train locally on the task and return what goes up."""

    @abstractmethod
    def evaluate(self, task: Task) -> dict[str, float]:
        """Metrics of the deployed model on the device's test split: at least `accuracy`."""

    def body_statistics(self, task: Task) -> ArrayGroup:
        """BatchNorm statistics (`body.*` keys) of the global body in `task` on the training
        split, for releasing the body of an algorithm that keeps its statistics personal.
        Algorithms without a global body have none."""
        return {}

    @abstractmethod
    def personal_state(self) -> ArrayGroup:
        """Everything the device keeps between rounds and restarts; never sent upstream."""

    @abstractmethod
    def load_personal_state(self, arrays: ArrayGroup) -> None:
        """Restore what `personal_state` returned (after a restart)."""
