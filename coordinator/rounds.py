"""The round state machine: who is selected, which replies count, when a round is over.

Pure logic with an injected clock, so quorum, deadline, stale and duplicate handling are unit
tested without a broker. A round is over when every selected device still online answered (a
reply that was rejected is an answer: the device sends no other), or when a quorum replied and
the grace period since the quorum passed, or at the deadline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from numpy.random import default_rng  # numpy loads it lazily: with the coordinator, not in round 1

from edge_sdk.protocol import Reason


def select_clients(available: list[str], fraction: float, seed: int, round_: int, *, minimum: int = 1) -> list[str]:
    """A seeded sample of `fraction` of the available devices (at least `minimum`).

    The draw depends only on (seed, round, the sorted ids), so a resumed run selects the same
    devices for the same round.
    """
    pool = sorted(available)
    if not pool:
        return []
    k = min(len(pool), max(minimum, int(round(fraction * len(pool)))))
    rng = default_rng([seed, round_])
    return sorted(pool[i] for i in rng.choice(len(pool), size=k, replace=False))


class Outcome(str, Enum):
    OPEN = "open"
    COMPLETE = "complete"  # every selected device that stayed online answered
    QUORUM = "quorum"  # a quorum replied and the grace period passed
    DEADLINE = "deadline"  # the deadline passed


@dataclass
class RoundCollector:
    """Tracks one round's replies. Times are in the clock's seconds (time.monotonic)."""

    round: int
    selected: frozenset[str]
    min_replies: int
    deadline: float
    grace: float
    replied: dict[str, str] = field(default_factory=dict)  # client id -> message id
    refused: dict[str, str] = field(default_factory=dict)  # client id -> id of its rejected reply
    offline: set[str] = field(default_factory=set)
    quorum_at: float | None = None

    def check(self, client_id: str, msg_id: str) -> Reason | None:
        """Why a reply from `client_id` must not be applied, or None if it may be."""
        if client_id not in self.selected:
            return Reason.NOT_SELECTED
        if client_id in self.replied:
            return Reason.DUPLICATE if self.replied[client_id] == msg_id else Reason.CONFLICTING_REPLY
        if self.refused.get(client_id) == msg_id:
            return Reason.DUPLICATE
        return None

    def accept(self, client_id: str, msg_id: str, now: float) -> None:
        self.replied[client_id] = msg_id
        self.refused.pop(client_id, None)
        self.offline.discard(client_id)
        if self.quorum_at is None and len(self.replied) >= self.min_replies:
            self.quorum_at = now

    def refuse(self, client_id: str, msg_id: str) -> None:
        """The device's reply was rejected: it counts for no quorum and is not waited for, but
        another reply from it (a new message id) may still be accepted."""
        self.refused[client_id] = msg_id
        self.offline.discard(client_id)

    def mark_offline(self, client_id: str) -> None:
        if client_id in self.selected and client_id not in self.replied:
            self.offline.add(client_id)

    def outcome(self, now: float) -> Outcome:
        waiting = self.selected - set(self.replied) - set(self.refused) - self.offline
        if not waiting and self.replied:
            return Outcome.COMPLETE
        if self.quorum_at is not None and now >= self.quorum_at + self.grace:
            return Outcome.QUORUM
        if now >= self.deadline or not waiting:
            return Outcome.DEADLINE
        return Outcome.OPEN

    def time_left(self, now: float) -> float:
        """Seconds until the outcome could change without a new message."""
        until = self.deadline
        if self.quorum_at is not None:
            until = min(until, self.quorum_at + self.grace)
        return max(0.0, until - now)

    @property
    def enough(self) -> bool:
        return len(self.replied) >= self.min_replies
