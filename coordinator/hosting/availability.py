"""When the simulated devices are online, and how fast they compute (`simulate --availability`,
`--speed-spread`).

Real fleets are never all online and differ in speed by 10x or more; a simulation where every
device is always there and equally fast says little about how rounds behave in one. Each device
of `edgepfl simulate` follows an availability `Schedule` (seconds after its worker's devices
joined the run):

- `always`: online for the whole run (the default);
- `random:P` or `random:P:PERIOD`: a two-state process per device, seeded by (run seed, device
  index): online spells last an exponential time of mean P x PERIOD seconds, offline spells one
  of mean (1 - P) x PERIOD (PERIOD 60 unless given), and the first spell is online with
  probability P, so each device is online a share P of the time, from the start;
- a CSV trace file with a header `device,offline,online`: each row one offline spell of a device
  (its index or its id `dev007`), from `offline` to `online` seconds; rows of a device must not
  overlap.

Going offline drops the device's MQTT connection without a DISCONNECT, so the broker publishes
its Last Will and the coordinator stops waiting for it; what it would publish meanwhile is lost.
Coming back is a new connection: the device says HELLO again and, if the open round selected it,
gets the round's request again (docs/PROTOCOL.md §9). A device whose work finished while it was
offline answers with its cached reply.

Speed: with `--speed-spread S` each device computes `speed_factor` times slower than the machine,
a factor drawn log-uniformly in [1, S] from (run seed, device index): after each computation it
holds (`SlowedLock`), it waits (factor - 1) times as long before it replies, outside the
worker's compute lock, so the other devices of its worker go on computing.
"""

from __future__ import annotations

import csv
import heapq
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from numpy.random import default_rng

from edge_sdk.config import ConfigError

from .device_ranges import client_id_for

log = logging.getLogger(__name__)

ALWAYS = "always"
DEFAULT_PERIOD = 60.0
"""Seconds of one online and one offline spell together, on average, under `random:P`."""
AVAILABILITY_STREAM = 0x0A7A11  # keeps these draws apart from every other use of (seed, index)
SPEED_STREAM = 0x05BEED
RETRY_SECONDS = 5.0
"""How long a device that could not come back online (the broker unreachable) waits to try again."""


@dataclass(frozen=True)
class RandomAvailability:
    """Each device online a share `online` of the time, in spells averaging `period` seconds together."""

    online: float
    period: float


@dataclass(frozen=True)
class TraceAvailability:
    """Offline spells per device index, (offline, online) in seconds, sorted and disjoint."""

    spells: dict[int, tuple[tuple[float, float], ...]]


Availability = RandomAvailability | TraceAvailability | None
"""None: every device online for the whole run."""


def parse_availability(text: str, clients: int) -> Availability:
    """The availability that `--availability` names, or a ConfigError naming the key."""
    if text == ALWAYS:
        return None
    if text.startswith("random:"):
        return _parse_random(text)
    path = Path(text)
    if not path.is_file():
        raise ConfigError(f"availability: expected always, random:P[:PERIOD] or a CSV trace file, got {text!r} "
                          "(no such file)")
    return TraceAvailability(read_trace(path, clients))


def _parse_random(text: str) -> RandomAvailability:
    parts = text.split(":")[1:]
    try:
        values = [float(part) for part in parts]
    except ValueError:
        values = []
    if len(values) not in (1, 2):
        raise ConfigError(f"availability: expected random:P or random:P:PERIOD with numbers, got {text!r}")
    online, period = values[0], values[1] if len(values) == 2 else DEFAULT_PERIOD
    if not 0 < online <= 1:
        raise ConfigError(f"availability: the online share P must be in (0, 1], got {online} in {text!r}")
    if not (math.isfinite(period) and period > 0):
        raise ConfigError(f"availability: PERIOD must be a positive number of seconds, got {period} in {text!r}")
    return RandomAvailability(online, period)


def read_trace(path: Path, clients: int) -> dict[int, tuple[tuple[float, float], ...]]:
    """A trace file's offline spells per device index; a ConfigError names the file and line."""
    spells: dict[int, list[tuple[float, float]]] = {}
    with open(path, newline="") as file:
        reader = csv.DictReader(file)
        if reader.fieldnames is None or {"device", "offline", "online"} - set(reader.fieldnames):
            raise ConfigError(f"availability: {path} needs the header device,offline,online, "
                              f"has {reader.fieldnames}")
        for row in reader:
            where = f"availability: {path}, line {reader.line_num}"
            index = _device_index(row["device"], clients, where)
            try:
                start, end = float(row["offline"]), float(row["online"])
            except (TypeError, ValueError):
                raise ConfigError(f"{where}: offline and online must be seconds, got {row['offline']!r}, "
                                  f"{row['online']!r}") from None
            if not (math.isfinite(start) and math.isfinite(end) and 0 <= start < end):
                raise ConfigError(f"{where}: needs 0 <= offline < online, got {start}, {end}")
            spells.setdefault(index, []).append((start, end))
    for index, device_spells in spells.items():
        device_spells.sort()
        for (_, end), (start, _) in zip(device_spells, device_spells[1:], strict=False):
            if start < end:
                raise ConfigError(f"availability: {path}: offline spells of {client_id_for(index)} overlap "
                                  f"at {start} s")
    return {index: tuple(device_spells) for index, device_spells in spells.items()}


def _device_index(text: str | None, clients: int, where: str) -> int:
    """A trace row's device: an index or an id `dev<index>`, one of the run's `clients`."""
    value = (text or "").strip()
    digits = value[3:] if value.startswith("dev") else value
    if not digits.isdigit() or int(digits) >= clients:
        raise ConfigError(f"{where}: device {text!r} is not one of the run's {clients} devices "
                          "(an index or dev<index>)")
    return int(digits)


def offline_spells(availability: Availability, seed: int, index: int) -> Iterator[tuple[float, float]]:
    """Device `index`'s offline spells in order, (offline, online) in seconds; endless under
    `random`, the same for the same (seed, index)."""
    if availability is None:
        return iter(())
    if isinstance(availability, TraceAvailability):
        return iter(availability.spells.get(index, ()))
    return _random_spells(availability, seed, index)


def _random_spells(availability: RandomAvailability, seed: int, index: int) -> Iterator[tuple[float, float]]:
    if availability.online >= 1:
        return
    rng = default_rng([AVAILABILITY_STREAM, seed, index])
    mean_online = availability.online * availability.period
    mean_offline = (1 - availability.online) * availability.period
    now = 0.0 if rng.random() >= availability.online else rng.exponential(mean_online)
    while True:
        back = now + rng.exponential(mean_offline)
        yield now, back
        now = back + rng.exponential(mean_online)


def speed_factor(spread: float, seed: int, index: int) -> float:
    """How many times slower than the machine device `index` computes: log-uniform in [1, spread]."""
    if spread <= 1:
        return 1.0
    return float(math.exp(default_rng([SPEED_STREAM, seed, index]).uniform(0.0, math.log(spread))))


class SlowedLock:
    """A compute lock for a device `factor` times slower than the machine: after it releases the
    worker's lock it waits (factor - 1) times as long as it held it, so its reply is late by that
    much while the worker's other devices compute."""

    def __init__(self, lock: Any, factor: float, *, clock: Callable[[], float] = time.monotonic,
                 wait: Callable[[float], Any] = time.sleep):
        self.lock, self.factor, self.clock, self.wait = lock, factor, clock, wait
        self._held_since = 0.0

    def __enter__(self) -> SlowedLock:
        self.lock.__enter__()
        self._held_since = self.clock()
        return self

    def __exit__(self, *exc: Any) -> None:
        held = self.clock() - self._held_since
        self.lock.__exit__(*exc)
        self.wait((self.factor - 1) * held)


class Connection(Protocol):
    """What the availability driver needs of a device's transport (edge_sdk.transport.MqttTransport)."""

    def drop_connection(self) -> None: ...

    def reconnect(self) -> None: ...


class Device(Protocol):
    client_id: str

    @property
    def finished(self) -> bool: ...


@dataclass
class _Spells:
    device: Device
    connection: Connection
    spells: Iterator[tuple[float, float]]
    offline: bool = False


class AvailabilityDriver(threading.Thread):
    """Takes a worker's devices offline and back on their schedules (seconds after `start`), until
    `stop` is set. Once a device that stayed online sees the run finished, the offline ones come
    back, so that they see it too (the coordinator's STATUS is retained) and their sessions end."""

    def __init__(self, devices: Sequence[tuple[Device, Connection, Iterator[tuple[float, float]]]],
                 stop: threading.Event, *, clock: Callable[[], float] = time.monotonic, poll: float = 0.5):
        super().__init__(name="availability", daemon=True)
        self.stop, self.clock, self.poll = stop, clock, poll
        self._devices = [_Spells(device, connection, spells) for device, connection, spells in devices]
        self.transitions = 0

    def run(self) -> None:
        start = self.clock()
        queue: list[tuple[float, int, bool]] = []  # (when, device, goes offline)
        for position, entry in enumerate(self._devices):
            self._schedule_next(queue, entry, position)
        while not self.stop.is_set() and not self._run_finished():
            now = self.clock() - start
            while queue and queue[0][0] <= now:
                _, position, goes_offline = heapq.heappop(queue)
                if self._switch(self._devices[position], goes_offline) or goes_offline:
                    if not goes_offline:
                        self._schedule_next(queue, self._devices[position], position)
                else:  # the broker was unreachable: try again
                    heapq.heappush(queue, (now + RETRY_SECONDS, position, False))
            until = queue[0][0] - now if queue else self.poll
            self.stop.wait(min(self.poll, max(0.0, until)))
        for entry in self._devices:
            if entry.offline:
                self._switch(entry, False)

    def _schedule_next(self, queue: list[tuple[float, int, bool]], entry: _Spells, position: int) -> None:
        spell = next(entry.spells, None)
        if spell is not None:
            heapq.heappush(queue, (spell[0], position, True))
            heapq.heappush(queue, (spell[1], position, False))

    def _run_finished(self) -> bool:
        return any(entry.device.finished for entry in self._devices if not entry.offline)

    def _switch(self, entry: _Spells, goes_offline: bool) -> bool:
        """Take the device offline or back; False when it could not come back (the broker unreachable)."""
        if entry.device.finished or entry.offline == goes_offline:
            return True
        try:
            if goes_offline:
                entry.connection.drop_connection()
            else:
                entry.connection.reconnect()
        except OSError as exc:
            log.warning("%s could not come back online: %s; trying again in %.0f s", entry.device.client_id, exc,
                        RETRY_SECONDS)
            return False
        entry.offline = goes_offline
        self.transitions += 1
        log.info("%s %s", entry.device.client_id, "went offline" if goes_offline else "came back online")
        return True
