"""The server side of an algorithm: initial state, what goes down, how replies are folded in.

The round loop (coordinator/players/) is written once; an algorithm only says what its global
state is, what each round's task carries, what a valid reply looks like, and how replies are
aggregated. The server never holds a device's personal state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from edge_sdk.algorithms import load as load_device
from edge_sdk.algorithms.base import NoHyper
from edge_sdk.data.task import TaskSpec
from edge_sdk.models import ModelSpec, build_model, check_capabilities
from edge_sdk.params import ArraySpec, spec_of
from edge_sdk.protocol import ArrayGroup

from ..aggregation.averaging import PartialSum
from ..aggregation.robust import AggregationSettings, Aggregator, make_aggregator
from .outgoing import check_outgoing

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


@dataclass(frozen=True)
class ServerContext:
    """What an algorithm may know about the run: `model` is the run's model spec (a name, an
    import path or a factory) and `task` what a sample is."""

    model: ModelSpec
    task: TaskSpec
    seed: int
    rounds: int
    clients: int
    aggregation: AggregationSettings = AggregationSettings()


class ServerAlgorithm(ABC):
    """One algorithm's coordinator side. `state` is the global state that is checkpointed."""

    id: ClassVar[str]
    Hyper: ClassVar[type[DataclassInstance]] = NoHyper
    releases_representation: ClassVar[bool] = False
    """True when the algorithm's product is a frozen representation to release after training."""
    asynchronous: ClassVar[str | None] = "its server step is not a weighted mean of changes to what it sent"
    """Why it cannot run buffered asynchronous aggregation (`mode async`); None when it can: its
    updates are new values of the arrays it sent, averaged by `accumulate` (coordinator/rounds/async_steps.py)."""
    lossy_uploads: ClassVar[str | None] = None
    """Why its uploads cannot take a lossy upload codec (`upload_codec` other than fp32); None when
    they can: every array it validates survives the codec's rounding."""
    sliced_broadcast: ClassVar[bool] = False
    """True when what goes down carries leading slices of the model's parameters (CD2-pFed): the
    check before sending (`check_outgoing`) then accepts each array's slice of the model's shape."""
    unshardable: ClassVar[str | None] = "its server step is not a sum of per-update terms"
    """Why its aggregation cannot be split over shard aggregators (`shards`); None when it can:
    then `begin_partial`, `partial`, `partial_spec` and `fold_partial` are provided."""

    def __init__(self, hyper: Any, context: ServerContext):
        self.hyper = hyper
        self.context = context
        self.check_model()
        self.state: dict[str, ArrayGroup] = self.initial_state()
        self.model_spec = {group: spec_of(arrays) for group, arrays in self.state.items()}
        """The initial state's names, shapes and dtypes: what a device's model accepts."""
        self.private_mean: Callable[[ArrayGroup], Aggregator] | None = None
        """Under DP, the round's aggregate (`coordinator.privacy`), set by the round loop."""

    def check_model(self) -> None:
        """Refuse, before anything starts, a model that lacks a capability the algorithm's device
        side needs (`ModelCapabilityError` naming both)."""
        check_capabilities(load_device(self.id), build_model(self.context.model, self.context.task,
                                                             seed=self.context.seed))

    def shares_body(self) -> bool:
        """Whether the global state holds every parameter of the model's body, whole: only then can
        it be released (LG-FedAvg keeps the whole body personal, FedBN its BatchNorm layers,
        CD2-pFed each layer's personal channels)."""
        model = build_model(self.context.model, self.context.task, seed=self.context.seed)
        body = {f"body.{name}": tuple(p.shape) for name, p in model.get_submodule("body").named_parameters()}
        held = {key: tuple(array.shape) for group in self.state.values() for key, array in group.items()}
        return bool(body) and all(held.get(key) == shape for key, shape in body.items())

    def check_outgoing(self, what: str, groups: dict[str, ArrayGroup]) -> None:
        """Refuse to send `groups` (in the request `what`) when every device would refuse them
        (`outgoing.OutgoingError`, naming the array): the run stops instead of waiting them out."""
        check_outgoing(what, groups, self.model_spec, sliced=self.sliced_broadcast)

    def new_aggregator(self, reference: ArrayGroup | None = None) -> Aggregator:
        """The run's aggregation rule (mean, median, trimmed mean, optionally clipped) for one
        round; `reference` is what was broadcast, for clipping. Under DP, the fixed-denominator
        noised mean instead (`private_mean`)."""
        if self.private_mean is not None:
            return self.private_mean(reference or {})
        return make_aggregator(self.context.aggregation, reference)

    @abstractmethod
    def initial_state(self) -> dict[str, ArrayGroup]:
        """The global state before round 1 (deterministic for the run's seed)."""

    def task_groups(self, round_: int) -> dict[str, ArrayGroup]:
        """Arrays broadcast with round `round_`'s TRAIN message."""
        return self.state

    def task_config(self, round_: int) -> dict[str, Any]:
        """Extra per-round settings broadcast with TRAIN."""
        return {}

    def eval_groups(self) -> dict[str, ArrayGroup]:
        """Arrays broadcast with EVALUATE (by default, the same global state)."""
        return self.state

    def assignment(self, client_id: str) -> dict[str, Any]:
        """Per-device settings sent in WELCOME at registration (e.g. a projection block)."""
        return {}

    @abstractmethod
    def update_spec(self, round_: int) -> dict[str, ArraySpec]:
        """Group -> array names, shapes and dtypes a TRAIN_RES of `round_` must carry exactly."""

    def upload_kinds(self) -> dict[str, str]:
        """What each TRAIN_RES group is (`coordinator.privacy.policy`: parameters, class
        statistics), for the DP mechanisms; a run under --dp refuses a group not named here."""
        return {}

    def validate_update(self, client_id: str, groups: dict[str, ArrayGroup], metrics: dict[str, float],  # noqa: B027
                        registered_examples: int) -> None:
        """Algorithm-specific sanity checks beyond shapes; raise `ValidationError` to reject.
        An optional hook, not abstract: the default accepts every update."""

    @abstractmethod
    def begin_round(self, round_: int) -> None:
        """Reset the accumulators for a new round."""

    @abstractmethod
    def accumulate(self, client_id: str, groups: dict[str, ArrayGroup], metrics: dict[str, float],
                   weight: float) -> None:
        """Fold one validated reply into the round's accumulators."""

    @abstractmethod
    def end_round(self, round_: int) -> None:
        """Turn the accumulators into the next global state."""

    def close_round(self, round_: int) -> None:
        """`end_round` as the round loop calls it: on one thread (`edge_sdk.training.one_thread`), so
        its float reductions run in one order whatever the machine's cores or OMP_NUM_THREADS:
        DC-PFL's calibration (Fashion-MNIST, Dir 0.1, 15 rounds) ended at 83.32% with the
        coordinator's two default threads and 85.35% with one, the run otherwise the same."""
        from edge_sdk.training import one_thread

        with one_thread():
            self.end_round(round_)

    # -- sharded aggregation (algorithms with `unshardable` None) -------------------------
    def begin_partial(self, round_: int, sent: dict[str, ArrayGroup]) -> None:
        """A shard aggregator's `begin_round`: its accumulators start against `sent`, what the
        round broadcast (the aggregator holds no global state of its own)."""
        raise NotImplementedError(f"{self.id}: {self.unshardable}")

    def partial(self) -> dict[str, PartialSum]:
        """A shard aggregator's accumulated sums, by group, to send to the coordinator."""
        raise NotImplementedError(f"{self.id}: {self.unshardable}")

    def partial_spec(self, round_: int) -> dict[str, ArraySpec]:
        """Group -> names, shapes and dtypes of the sums a partial of `round_` carries."""
        raise NotImplementedError(f"{self.id}: {self.unshardable}")

    def fold_partial(self, round_: int, partial: dict[str, PartialSum]) -> None:
        """The coordinator folds one shard's checked partial of `round_` into the round's accumulators
        (instead of that shard's updates); `end_round` then makes the state as usual."""
        raise NotImplementedError(f"{self.id}: {self.unshardable}")
