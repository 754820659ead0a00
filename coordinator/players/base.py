"""What every round player is (`RoundPlayer`) and what it gives a round's record (`TrainedRound`).

A player plays one round (or, asynchronously, one aggregation step), reacts to a device that
registers again or goes offline, and takes the updates that arrive outside the open request
(late updates, asynchronous arrivals); the coordinator routes messages to it and writes the
round's record from what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from edge_sdk.channel import Received

    from ..events import RoundDevices
    from ..rounds.async_steps import StepRecord
    from ..rounds.secagg import SecureRoundRecord
    from ..shards.sharding import ShardRound


@dataclass(frozen=True)
class TrainedRound:
    """What a round's training (or an async aggregation step) gave its record: devices asked,
    updates aggregated, how it ended, and who replied, was refused, late or missing."""

    selected: int
    participants: int
    outcome: str
    replied: int
    devices: RoundDevices
    folded: int = 0
    sharded: ShardRound | None = None
    secure: SecureRoundRecord | None = None
    step: StepRecord | None = None


class RoundPlayer(Protocol):
    """How a run's rounds are played: synchronous, secure or asynchronous."""

    label: str
    """What the log calls one of its rounds ("round", "step")."""

    def play(self, round_: int, started: float) -> TrainedRound:
        """Play round (or step) `round_`, begun at `started` (the run's clock)."""

    def on_hello(self, client_id: str) -> None:
        """`client_id` registered again while no open request waits for it."""

    def on_offline(self, client_id: str) -> None:
        """`client_id` went offline."""

    def takes(self, received: Received) -> bool:
        """Take an update (a TRAIN_RES of a registered device of this run) before the open
        request's handler does: an asynchronous arrival, a late update of the round before;
        False: the handler takes it."""
