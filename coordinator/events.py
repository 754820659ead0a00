"""What the coordinator publishes as a run goes: typed events for observers.

Benchmarks, tests and tools subscribe to a `Coordinator`'s events instead of wrapping its
methods. Events are emitted synchronously on the coordinator's thread, in the order they happen
(a callback that is slow slows the round down; one that raises stops the run). Times are
seconds on the coordinator's clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edge_sdk.channel import ChannelSnapshot


@dataclass(frozen=True)
class RunStarted:
    """`Coordinator.run` begins: run `run_id`, `after_round` of its `rounds` already played (a
    resumed run: more than 0; a finished one, which is left as it is: all of them)."""

    run_id: str
    after_round: int
    rounds: int
    bytes_so_far: int = 0
    """Bytes up and down (as published) of the rounds already played."""


@dataclass(frozen=True)
class RegistrationOpened:
    """The coordinator listens for devices; `expected` is how many it waits for."""

    expected: int


@dataclass(frozen=True)
class DevicesRegistered:
    """Registration is over: `devices` registered, `trainers` of them train, after `seconds`."""

    devices: int
    trainers: int
    seconds: float


@dataclass(frozen=True)
class RoundStarted:
    """A round begins: the devices selected to train, before the algorithm's `begin_round`."""

    round: int
    selected: tuple[str, ...]


@dataclass(frozen=True)
class UpdateAccepted:
    """One device's update passed validation and was folded in."""

    round: int
    device: str
    bytes: int
    """The update's encoded size (reassembled, if it came in chunks)."""
    seconds: float
    """Since the round started."""
    validation_seconds: float
    """Decoding the upload codec, `check_update` and the algorithm's own checks."""
    accumulate_seconds: float
    """The algorithm's `accumulate`."""


@dataclass(frozen=True)
class RoundAggregated:
    """The algorithm's `end_round` turned the round's updates into the new global state (not
    emitted for a round below the quorum, which leaves the state unchanged)."""

    round: int
    participants: int
    seconds: float
    """The algorithm's `end_round`."""


@dataclass(frozen=True)
class RoundEvaluated:
    """The devices' evaluation of `round` came back from `devices` of them."""

    round: int
    devices: int
    accuracy: float | None
    """Mean personalized accuracy over the trainers that are not held out (None without any)."""
    seconds: float


@dataclass(frozen=True)
class RoundDevices:
    """A round device by device: who replied, was refused (and why), was late or missing (the
    counts of the round's record, by name), and the accuracy each evaluated device reported."""

    replied: tuple[str, ...] = ()
    refused: dict[str, str] = field(default_factory=dict)
    """Device -> the reason its answer was rejected (a `Reason` value)."""
    late: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    accuracy: dict[str, float] = field(default_factory=dict)
    """The round's evaluation (none without one, or under private evaluation)."""


@dataclass(frozen=True)
class DeviceRefused:
    """A device said it cannot take a request of round `round` (its model or settings do not fit
    what was sent): the reason code and its detail."""

    round: int
    client_id: str
    reason: str
    detail: str


@dataclass(frozen=True)
class RoundEnded:
    """The round is checkpointed; `record` is its line in metrics.jsonl, `channel` what the
    coordinator's channel did during the round (messages, bytes, rejections, seconds), `devices`
    who did what in it."""

    round: int
    record: dict[str, Any]
    channel: ChannelSnapshot
    devices: RoundDevices = field(default_factory=RoundDevices)


@dataclass(frozen=True)
class DeviceOnline:
    """A device (or shard aggregator, `kind` "aggregator") registered or came back with a HELLO;
    `online` devices and `registered` devices now (neither counts the shard aggregators)."""

    device: str
    kind: str
    online: int
    registered: int


@dataclass(frozen=True)
class DeviceOffline:
    """A device online until now went offline (its Last Will); `online` devices are left."""

    device: str
    online: int


@dataclass(frozen=True)
class ReleaseServed:
    """The released representation was sent to `device`, which asked for it (FETCH)."""

    device: str
    sha256: str
    bytes: int
    version: int | None = None
    """Its number among the run's releases."""


Event = (RunStarted | RegistrationOpened | DevicesRegistered | RoundStarted | UpdateAccepted | DeviceRefused
         | RoundAggregated
         | RoundEvaluated | RoundEnded | DeviceOnline | DeviceOffline | ReleaseServed)


class EventBus:
    """Callbacks by event type; `emit` calls those subscribed to the event's type, in order."""

    def __init__(self) -> None:
        self._subscribers: list[tuple[tuple[type, ...], Callable[[Any], None]]] = []

    def subscribe(self, callback: Callable[[Any], None], *kinds: type) -> None:
        """Call `callback(event)` for every event of the given types (all events without any)."""
        unknown = [kind for kind in kinds if kind not in Event.__args__]
        if unknown:
            raise TypeError(f"not coordinator events: {', '.join(getattr(k, '__name__', str(k)) for k in unknown)}")
        self._subscribers.append((kinds or Event.__args__, callback))

    def emit(self, event: Event) -> None:
        for kinds, callback in self._subscribers:
            if isinstance(event, kinds):
                callback(event)
