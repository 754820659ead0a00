"""One round of a server algorithm with its devices in this process, through the wire encoding.

Tests and benchmarks that drive an algorithm without a broker use this instead of a loop of
their own: `begin_round`, the TRAIN task, each device's `fit`, the coordinator's checks on
every reply (`checked_update`), `accumulate`, `end_round`. The task and every reply are
encoded and decoded as they would be over MQTT, so nothing crosses as a Python object (a
personal parameter cannot slip through) and the bytes each way are counted.

`InProcessRound` is the coordinator's side alone, for callers that reach their devices some
other way (the overhead benchmark's worker processes); `play_round` runs a whole round with
device algorithms (anything with `fit(Task) -> FitResult`) held in a mapping by device id.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from edge_sdk import codecs, wire
from edge_sdk.algorithms.base import FitResult, Task
from edge_sdk.protocol import COORDINATOR, ArrayGroup, Envelope, Kind

from ..aggregation.validation import UpdateLimits, checked_update
from ..algorithms.base import ServerAlgorithm

NO_LIMITS = UpdateLimits(max_examples=2**62, max_update_norm=0.0)
"""Updates weighted by the examples they claim, without a norm bound."""


class Trainer(Protocol):
    """What `play_round` needs from a device: local training on a task."""

    def fit(self, task: Task) -> FitResult: ...


@dataclass(frozen=True)
class FixedUpdate:
    """A device that uploads the given update whatever came down: for tests of a server's
    arithmetic and for benchmarks of the coordinator alone."""

    groups: dict[str, ArrayGroup]
    num_examples: int

    def fit(self, task: Task) -> FitResult:
        return FitResult(self.groups, {"num_examples": self.num_examples})


class InProcessRound:
    """The coordinator's side of one round: `begin_round` and the TRAIN envelope on creation,
    `accept` for each reply (checked, then accumulated), `finish` for `end_round`."""

    def __init__(self, server: ServerAlgorithm, round_: int, selected: Iterable[str], *, run_id: str = "in-process",
                 codec: str | codecs.UploadCodec = "fp32", limits: UpdateLimits = NO_LIMITS):
        self.server, self.round, self.codec, self.limits = server, round_, codec, limits
        server.begin_round(round_)
        self.sent = server.task_groups(round_)
        self.task = Envelope(Kind.TRAIN, COORDINATOR, run_id=run_id, round=round_, groups=self.sent,
                             config={"selected": list(selected), **server.task_config(round_)})
        self.weights: dict[str, float] = {}

    def accept(self, reply: Envelope, registered_examples: int | None = None) -> float:
        """Check `reply` as the coordinator does and fold it in; returns its weight. Without
        `registered_examples` the device is taken at the examples it claims. A reply the
        coordinator would refuse raises its `ValidationError`."""
        registered = registered_examples if registered_examples is not None else _registered_as_claimed(reply)
        groups, weight = checked_update(self.server, self.round, reply, self.sent, registered, self.limits, self.codec)
        self.server.accumulate(reply.sender, groups, reply.metrics, weight)
        self.weights[reply.sender] = weight
        return weight

    def finish(self) -> None:
        """Aggregate: the algorithm's `end_round`."""
        self.server.close_round(self.round)


def _registered_as_claimed(reply: Envelope) -> int:
    """The registration of a device taken at the examples `reply` claims: the claim rounded up,
    so the update's weight is its claim (capped by the limits) as it would be with no rounding;
    a claim that is no finite number registers none (`checked_update` refuses the malformed)."""
    claimed = reply.metrics.get("num_examples", 0)
    return math.ceil(claimed) if isinstance(claimed, (int, float)) and math.isfinite(claimed) else 0


@dataclass
class RoundResult:
    """What one in-process round did: each device's `fit` result (as the device returned it),
    the weights the server folded in, and the encoded bytes each way."""

    round: int
    results: dict[str, FitResult] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    bytes_down: int = 0
    """The TRAIN envelope, once: it is a broadcast."""
    bytes_up: dict[str, int] = field(default_factory=dict)
    """Each device's TRAIN_RES envelope."""


def play_round(server: ServerAlgorithm, devices: Mapping[str, Trainer], round_: int, *,
               codec: str | codecs.UploadCodec = "fp32",
               limits: UpdateLimits = NO_LIMITS) -> RoundResult:
    """One round as the coordinator plays it, every device of `devices` selected, replies
    folded in in the mapping's order. A reply the coordinator would refuse raises."""
    coordinator = InProcessRound(server, round_, devices, codec=codec, limits=limits)
    down = wire.encode(coordinator.task)
    outcome = RoundResult(round_, bytes_down=len(down))
    for client_id, device in devices.items():
        task = wire.decode(down)
        result = device.fit(Task(task.round, task.groups, task.config))
        rounding = codecs.rounding_generator(server.context.seed, round_, client_id)  # topk: no error feedback here
        up = wire.encode(Envelope(Kind.TRAIN_RES, client_id, run_id=task.run_id, round=round_,
                                  groups=codecs.encode(codec, result.groups, task.groups, rng=rounding),
                                  metrics=result.metrics))
        coordinator.accept(wire.decode(up))
        outcome.results[client_id] = result
        outcome.bytes_up[client_id] = len(up)
    coordinator.finish()
    outcome.weights = dict(coordinator.weights)
    return outcome
