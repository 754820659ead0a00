"""Buffered asynchronous aggregation (`--mode async`, FedBuff: Nguyen et al., AISTATS 2022).

Devices train whenever they are free, each on the latest global state it was sent; the
coordinator keeps at most `concurrency` of them training and folds every `buffer` arrivals into
a new version of the global state (an aggregation step). An update computed on version v that
arrives when the state is at version w has staleness w - v: above `max_staleness` it is refused
(`too_stale`, counted); otherwise it counts as a change to what its device was sent, scaled by
the polynomial staleness weight of FedBuff, (1 + staleness)^-a with a = `staleness_exponent`
(0.5, the paper's choice), and applied to the current state (`rebase`). The algorithm then
averages the rebased updates, weighted by examples, exactly as it averages a round's updates:
the new state is current + sum_i n_i s(t_i) (x_i - sent_i) / sum_i n_i, FedBuff's step with a
server learning rate of 1 and example weights.

Pure bookkeeping with an injected clock (`AsyncSteps`): who trains on which version, what each
version sent (kept while an update of it may still be applied), and each step's staleness
histogram. The asynchronous player (coordinator/players/asynchronous.py) sends and receives.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.random import default_rng

from edge_sdk.config import ConfigError
from edge_sdk.protocol import ArrayGroup, Envelope

if TYPE_CHECKING:
    from ..algorithms.base import ServerAlgorithm
    from ..config.run_config import RunConfig

DISPATCH_STREAM = 0xA5E7C  # keeps the dispatch order's draws apart from the rounds' selections
STATISTICS = ("running_mean", "running_var", "num_batches_tracked")
"""BatchNorm's buffers (torch's names): estimates of the device's data, not trained parameters."""


def check_async_run(config: RunConfig, algorithm: type[ServerAlgorithm]) -> None:
    """Refuse by name (ConfigError) an async run of what cannot run asynchronously."""
    if config.round.mode != "async":
        return
    settings = config.round
    refusals = [
        (algorithm.asynchronous is not None, f"{config.run.algorithm} cannot: {algorithm.asynchronous}"),
        (config.secagg.secure_aggregation, "secure_aggregation needs a round's devices to mask their updates "
                                           "together"),
        (config.privacy.enabled, "dp calibrates its noise to a round's sample of devices"),
        (settings.shards > 0, "shards sum a round's updates per shard"),
        (settings.late_updates != "discard", "late_updates is for rounds: async weighs every update by its "
                                            "staleness (max_staleness)"),
        (settings.fraction < 1, "fraction samples a round's devices: async keeps --concurrency devices training"),
    ]
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"mode async: {why}")


def staleness_factor(staleness: int, exponent: float) -> float:
    """FedBuff's polynomial staleness weight: (1 + staleness)^-exponent."""
    return float((1.0 + staleness) ** -exponent)


def rebase(update: dict[str, ArrayGroup], sent: dict[str, ArrayGroup], current: dict[str, ArrayGroup],
           factor: float) -> dict[str, ArrayGroup]:
    """`update`, computed from `sent`, as a change applied to `current`: current + factor x
    (update - sent) for every floating-point parameter, in float64 and back to its dtype. Other
    arrays go as uploaded: counters, and BatchNorm's running statistics (`STATISTICS`), which the
    device estimated on its data rather than trained from what it was sent (a rebased variance
    could even turn negative); they are averaged as in a round."""
    rebased: dict[str, ArrayGroup] = {}
    for group, arrays in update.items():
        rebased[group] = {}
        for name, value in arrays.items():
            before, now = sent.get(group, {}).get(name), current.get(group, {}).get(name)
            if (before is None or now is None or not np.issubdtype(value.dtype, np.floating)
                    or name.rsplit(".", 1)[-1] in STATISTICS):
                rebased[group][name] = value
                continue
            change = value.astype(np.float64) - before.astype(np.float64)
            rebased[group][name] = (now.astype(np.float64) + factor * change).astype(value.dtype)
    return rebased


@dataclass(frozen=True)
class InFlight:
    """A device training on `version`, asked by `request` at `started`."""

    device: str
    request: Envelope
    version: int
    started: float

    @property
    def msg_id(self) -> str:
        return self.request.msg_id


@dataclass
class StepRecord:
    """What one aggregation step folded: arrivals, their staleness, and the updates refused."""

    arrivals: int = 0
    staleness: Counter[int] = field(default_factory=Counter)
    too_stale: int = 0
    dispatched: int = 0

    def to_plain(self) -> dict[str, Any]:
        return {"arrivals": self.arrivals, "dispatched": self.dispatched, "too_stale": self.too_stale,
                "staleness": {str(k): v for k, v in sorted(self.staleness.items())}}


class AsyncSteps:
    """The in-flight devices, the versions they train on and the open step's record."""

    def __init__(self, *, buffer: int, max_staleness: int, concurrency: int, exponent: float, seed: int,
                 version: int = 0):
        self.buffer, self.max_staleness, self.concurrency, self.exponent = buffer, max_staleness, concurrency, exponent
        self.seed = seed
        self.version = version
        """The global state's version: the aggregation steps completed."""
        self.flights: dict[str, InFlight] = {}
        self.sent: dict[int, dict[str, ArrayGroup]] = {}
        self.step = StepRecord()
        self._draws = 0

    def to_dispatch(self, online: list[str]) -> list[str]:
        """The idle online devices to start now, up to `concurrency` in flight (0: all of them),
        in a seeded order (the same for the same version, draw and idle devices)."""
        idle = sorted(set(online) - set(self.flights))
        room = len(idle) if self.concurrency == 0 else max(0, self.concurrency - len(self.flights))
        if not idle or room == 0:
            return []
        self._draws += 1
        order = default_rng([DISPATCH_STREAM, self.seed, self.version, self._draws]).permutation(len(idle))
        return sorted(idle[i] for i in order[:room])

    def dispatched(self, devices: list[str], request: Envelope, now: float) -> None:
        """`devices` were asked, by TRAIN `request`, to train on the current version (its groups)."""
        self.sent.setdefault(self.version, request.groups)
        for device in devices:
            self.flights[device] = InFlight(device, request, self.version, now)
        self.step.dispatched += len(devices)

    def flight_of(self, device: str, in_reply_to: Any) -> InFlight | None:
        """The flight a reply from `device` naming request `in_reply_to` ends, or None if it ends none."""
        flight = self.flights.get(device)
        return flight if flight is not None and flight.msg_id == in_reply_to else None

    def land(self, flight: InFlight) -> tuple[int, dict[str, ArrayGroup] | None]:
        """End `flight`: its staleness, and what its version sent, or None when it is too stale
        (counted) and must be refused."""
        del self.flights[flight.device]
        staleness = self.version - flight.version
        if staleness > self.max_staleness:
            self.step.too_stale += 1
            return staleness, None
        return staleness, self.sent[flight.version]

    def folded(self, staleness: int) -> None:
        """An update of that staleness was checked and folded into the open step."""
        self.step.arrivals += 1
        self.step.staleness[staleness] += 1

    def lost(self, device: str) -> None:
        """`device` went offline: it trains no more (a reply it sends later ends no flight)."""
        self.flights.pop(device, None)

    def expired(self, now: float, timeout: float) -> list[str]:
        """Devices in flight for longer than `timeout` s (their reply lost, or they died without a
        Last Will): they train no more, and may be asked again."""
        gone = sorted(d for d, flight in self.flights.items() if now - flight.started > timeout)
        for device in gone:
            del self.flights[device]
        return gone

    @property
    def full(self) -> bool:
        return self.step.arrivals >= self.buffer

    def close_step(self) -> StepRecord:
        """The step's record; the state moves to the next version, and versions that no flight
        can still use (older than `max_staleness`, or with no flight left) are let go."""
        record, self.step = self.step, StepRecord()
        self.version += 1
        oldest = self.version - self.max_staleness
        used = {flight.version for flight in self.flights.values()}
        self.sent = {v: groups for v, groups in self.sent.items() if v >= oldest and v in used}
        return record
