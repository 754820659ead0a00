"""`RunContext`: what the round players share with the coordinator that built them.

The run's settings and collaborators (channel, algorithm, registry, outbox, ledger, metrics,
events, shards, late updates), its privacy (`NoPrivacy` without `--dp`), the devices held out,
and the reply pacing: the slowest accepted reply so far, from which each request's windows grow
(`rounds.collector.round_windows`). `serve` and `status` are the coordinator's: handle one message (its
routing), publish the retained STATUS.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from edge_sdk.channel import Channel, Received
from edge_sdk.protocol import Reason, Topics

from ..rounds.collector import round_windows

if TYPE_CHECKING:
    from edge_sdk.models import ModelSpec

    from ..aggregation.validation import UpdateLimits
    from ..algorithms.base import ServerAlgorithm
    from ..config.run_config import RunConfig
    from ..events import EventBus
    from ..fleet.devices import DeviceRegistry
    from ..fleet.outbox import Outbox, RunPosition
    from ..privacy.none import NoPrivacy
    from ..privacy.run import RunPrivacy
    from ..rounds.collector import LateUpdates
    from ..run.folder import RunFolder
    from ..run.ledger import Ledger
    from ..run.report_files import MetricsLog
    from ..shards.coordinator_side import ShardedRounds


@dataclass
class RunContext:
    """One run's collaborators, as its players use them."""

    config: RunConfig
    channel: Channel
    clock: Callable[[], float]
    events: EventBus
    folder: RunFolder
    model: ModelSpec
    algorithm: ServerAlgorithm
    privacy: RunPrivacy | NoPrivacy
    limits: UpdateLimits
    registry: DeviceRegistry
    position: RunPosition
    metrics: MetricsLog
    ledger: Ledger
    outbox: Outbox
    sharding: ShardedRounds
    late: LateUpdates
    serve: Callable[[float, Callable[[Received], None]], None]
    """Handle at most one message within the timeout: the coordinator's routing, replies to the callback."""
    status: Callable[[str], None]
    """Publish the retained STATUS with this state."""
    holdout: frozenset[str] = frozenset()
    slowest_reply: float | None = None
    """Seconds from a round's start to its slowest accepted update so far."""

    @property
    def run_id(self) -> str:
        return self.position.run_id

    @property
    def completed(self) -> int:
        """Rounds completed and checkpointed."""
        return self.position.completed

    @property
    def topics(self) -> Topics:
        return self.channel.topics

    def replied_after(self, seconds: float) -> None:
        """An update was accepted `seconds` after its request: the windows grow with the slowest."""
        self.slowest_reply = max(self.slowest_reply or 0.0, seconds)

    def windows(self) -> tuple[float, float]:
        """(grace, timeout) of the next request, from the settings and the replies measured."""
        settings = self.config.round
        return round_windows(settings.quorum_grace, settings.round_timeout, settings.patience, self.slowest_reply)

    def trainers_online(self) -> list[str]:
        """The online trainers that may train: all but the held-out ones."""
        return [c for c in self.registry.online("trainer") if c not in self.holdout]

    def task_config(self, round_: int, eligible: int) -> dict[str, Any]:
        """What a round's TRAIN config carries beyond `selected`: the algorithm's keys, and the
        round's DP (of a sample drawn from `eligible` trainers)."""
        return {**self.algorithm.task_config(round_), **self.privacy.task_config(eligible)}

    def stale_reply(self, received: Received) -> None:
        """Refuse a reply while no request is open (`stale`)."""
        envelope = received.envelope
        self.outbox.reject(envelope, Reason.STALE,
                           f"{envelope.kind.value} from {envelope.sender} for round {envelope.round}")

    def serve_stale(self, timeout: float) -> None:
        """Handle at most one message while no request is open: replies are stale."""
        self.serve(timeout, self.stale_reply)
