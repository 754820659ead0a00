"""The round state machine: who is selected, which replies count, when a round is over.

Pure logic with an injected clock, so quorum, deadline, stale and duplicate handling are unit
tested without a broker. A round is over when every selected device still online answered (a
reply that was rejected is an answer: the device sends no other), or when a quorum replied and
the grace period since the quorum passed, or at the deadline. While the quorum still needs a
selected device that went offline before answering, the round waits `rejoin` seconds for it: a
device whose connection dropped reconnects, says HELLO and gets the request again.

How long a round waits scales with what was measured (`round_windows`), and an update that
arrives after its round closed goes where the run's late-update policy says (`LateUpdates`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from numpy.random import Generator, default_rng  # numpy loads it lazily: with the coordinator, not in round 1

from edge_sdk.config import ConfigError
from edge_sdk.protocol import ArrayGroup, Reason, Refusal


class EveryDeviceRefused(ConfigError):
    """Every device asked refused a request itself (its model or settings do not fit what was
    sent) and none answered it: the run stops, naming the reason, instead of playing on."""


def every_device_refused(what: str, round_: int, asked: Iterable[str], answered: Iterable[str],
                         refusals: Mapping[str, Refusal]) -> EveryDeviceRefused | None:
    """The stop to raise when each of `asked` refused (`refusals`) and none of them is in
    `answered`; None otherwise."""
    asked = sorted(asked)
    if not asked or set(answered) & set(asked) or any(device not in refusals for device in asked):
        return None
    reasons = sorted({refusals[device].reason.value for device in asked})
    first = refusals[asked[0]]
    return EveryDeviceRefused(f"round {round_}: every device asked ({len(asked)}) refused the {what} "
                              f"({', '.join(reasons)}); {asked[0]}: {first.detail}")


def select_clients(available: list[str], fraction: float, seed: int, round_: int, *, minimum: int = 1,
                   rng: Generator | None = None) -> list[str]:
    """A seeded sample of `fraction` of the available devices (at least `minimum`).

    The draw depends only on (seed, round, the sorted ids), so a resumed run selects the same
    devices for the same round; with `rng`, it is that generator's (a private run's secret draw).
    """
    pool = sorted(available)
    if not pool:
        return []
    k = min(len(pool), max(minimum, int(round(fraction * len(pool)))))
    rng = rng or default_rng([seed, round_])
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
    rejoin: float = 0.0
    """Seconds a device that went offline before answering is still waited for, while the quorum
    needs it (0: not waited for)."""
    offline_since: dict[str, float] = field(default_factory=dict)
    """When each device of `offline` that may come back went offline (not those of a lost shard)."""

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
        self._back(client_id)
        if self.quorum_at is None and len(self.replied) >= self.min_replies:
            self.quorum_at = now

    def refuse(self, client_id: str, msg_id: str) -> None:
        """The device's reply was rejected: it counts for no quorum and is not waited for, but
        another reply from it (a new message id) may still be accepted."""
        self.refused[client_id] = msg_id
        self._back(client_id)

    def lose(self, client_id: str) -> int:
        """A selected device whose reply will not be aggregated after all (its shard's aggregator
        was lost): it counts as missing, not replied; returns 1 if its reply had been accepted."""
        if client_id not in self.selected or client_id in self.refused:
            return 0
        accepted = self.replied.pop(client_id, None) is not None
        self.offline.add(client_id)
        self.offline_since.pop(client_id, None)
        if len(self.replied) < self.min_replies:
            self.quorum_at = None
        return int(accepted)

    def rejoined(self, client_id: str) -> bool:
        """`client_id` said HELLO again while the round is open (it reconnected, and may have
        missed the request): waited for again if selected, and True when it still owes its reply."""
        owes = client_id in self.selected and client_id not in self.replied and client_id not in self.refused
        if owes:
            self._back(client_id)
        return owes

    def mark_offline(self, client_id: str, now: float) -> None:
        """`client_id` went offline (its Last Will) at `now`: not waited for, unless the quorum
        needs it, and then for `rejoin` seconds."""
        if client_id in self.selected and client_id not in self.replied:
            self.offline.add(client_id)
            self.offline_since[client_id] = now

    def _back(self, client_id: str) -> None:
        self.offline.discard(client_id)
        self.offline_since.pop(client_id, None)

    def _rejoin_pending(self, now: float) -> bool:
        """The quorum is not in, and the devices that went offline less than `rejoin` seconds
        ago could still bring it in by coming back."""
        returning = sum(now < since + self.rejoin for since in self.offline_since.values())
        return not self.enough and len(self.replied) + returning >= self.min_replies

    def outcome(self, now: float) -> Outcome:
        settled = not self.waiting and not self._rejoin_pending(now)  # nobody left to wait for
        if settled and self.replied:
            return Outcome.COMPLETE
        if self.quorum_at is not None and now >= self.quorum_at + self.grace:
            return Outcome.QUORUM
        if now >= self.deadline or settled:
            return Outcome.DEADLINE
        return Outcome.OPEN

    def time_left(self, now: float) -> float:
        """Seconds until the outcome could change without a new message."""
        until = self.deadline
        if self.quorum_at is not None:
            until = min(until, self.quorum_at + self.grace)
        rejoin_ends = (since + self.rejoin for since in self.offline_since.values())
        until = min([until, *(end for end in rejoin_ends if end > now)])
        return max(0.0, until - now)

    @property
    def enough(self) -> bool:
        return len(self.replied) >= self.min_replies

    @property
    def waiting(self) -> frozenset[str]:
        """Selected devices still online that neither replied nor were refused: once the round
        closes, they are late."""
        return frozenset(self.selected - set(self.replied) - set(self.refused) - self.offline)


def round_windows(quorum_grace: float, round_timeout: float, patience: float,
                  slowest_reply: float | None) -> tuple[float, float]:
    """(grace, timeout) of the next round: how long it waits for stragglers once the quorum
    replied, and how long it may last.

    The rule: `slowest_reply` is the longest time from a round's start to an accepted update
    measured so far in the run. Once one is measured, grace = max(quorum_grace, patience x
    slowest_reply) and timeout = max(round_timeout, patience x slowest_reply). Before any is
    measured, the quorum does not end the round early: grace = timeout = round_timeout, so
    the first round waits for every selected device up to the deadline. `patience` 0 keeps the
    configured times as they are.
    """
    if patience <= 0:
        return quorum_grace, round_timeout
    if slowest_reply is None:
        return round_timeout, round_timeout
    scaled = patience * slowest_reply
    return max(quorum_grace, scaled), max(round_timeout, scaled)


def staleness_weight(weight: float, staleness: int) -> float:
    """The weight of an update folded into a round `staleness` rounds after its own:
    weight / (1 + staleness), so an update one round late counts half."""
    return weight / (1 + staleness)


@dataclass
class LateUpdate:
    """A checked update of a closed round, waiting to be folded into the next one."""

    sender: str
    groups: dict[str, ArrayGroup]
    metrics: dict[str, Any]
    weight: float
    """Already scaled by `staleness_weight`."""


@dataclass
class LateUpdates:
    """Updates that arrive after their round closed, under the run's policy (`late_updates`):
    `discard` drops them, counted; `next_round` checks them against what their round sent and
    folds them into the next round that aggregates, at `staleness_weight(weight, 1)`, unless
    their device sent a fresh update to that round (the fresh one wins).

    Only the last closed training round is open to late updates: one that arrives after the
    next round closed is stale."""

    policy: str
    round: int = 0
    request_id: str | None = None
    sent: dict[str, ArrayGroup] = field(default_factory=dict)
    """What the closed round broadcast (kept under `next_round` only: updates decode against it)."""
    waiting: set[str] = field(default_factory=set)
    pending: list[LateUpdate] = field(default_factory=list)
    discarded: int = 0

    @property
    def folds(self) -> bool:
        return self.policy == "next_round"

    def close(self, round_: int, request_id: str, sent: dict[str, ArrayGroup], late: frozenset[str]) -> None:
        """Round `round_` (broadcast as `request_id`) closed while the `late` devices were training."""
        self.round, self.request_id, self.waiting = round_, request_id, set(late)
        self.sent = sent if self.folds else {}

    def expects(self, sender: str, round_: int, in_reply_to: Any) -> bool:
        """True for the first reply to the closed round's request from a device it stopped waiting for."""
        return (self.request_id is not None and round_ == self.round and in_reply_to == self.request_id
                and sender in self.waiting)

    def arrived(self, sender: str) -> None:
        """The late reply of `sender` was handled (folded, refused or discarded): not expected again."""
        self.waiting.discard(sender)

    def discard(self, sender: str) -> None:
        self.arrived(sender)
        self.discarded += 1

    def keep(self, sender: str, groups: dict[str, ArrayGroup], metrics: dict[str, Any], weight: float) -> None:
        """A checked late update, to fold into the next round."""
        self.arrived(sender)
        self.pending.append(LateUpdate(sender, groups, metrics, staleness_weight(weight, 1)))

    def take(self, fresh: frozenset[str], *, aggregating: bool) -> list[LateUpdate]:
        """The pending late updates to fold into the round closing now, whose `fresh` devices
        replied themselves (their late updates are discarded, counted); all are discarded when
        the round does not aggregate (below its quorum)."""
        pending, self.pending = self.pending, []
        kept = [update for update in pending if aggregating and update.sender not in fresh]
        self.discarded += len(pending) - len(kept)
        return kept
