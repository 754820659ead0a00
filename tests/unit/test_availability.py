"""Simulated availability and speed (coordinator/hosting/availability.py): what `--availability` and
`--speed-spread` accept and refuse, the seeded schedules and speed factors, the slowed compute
lock, and the driver that takes devices offline and back."""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

import pytest

from coordinator.hosting.availability import (AvailabilityDriver, RandomAvailability, SlowedLock, TraceAvailability,
                                      offline_spells, parse_availability, speed_factor)
from coordinator.config.run_config import RunConfig
from edge_sdk.config import ConfigError

WAIT = 10.0


def test_always_is_no_schedule_and_random_takes_a_share_and_a_period():
    assert parse_availability("always", 4) is None
    assert parse_availability("random:0.5", 4) == RandomAvailability(0.5, 60.0)
    assert parse_availability("random:0.25:10", 4) == RandomAvailability(0.25, 10.0)


@pytest.mark.parametrize("text, names", [
    ("random:", "random:P or random:P:PERIOD"),
    ("random:0.5:1:2", "random:P or random:P:PERIOD"),
    ("random:0", "(0, 1]"),
    ("random:1.5", "(0, 1]"),
    ("random:0.5:-3", "PERIOD"),
    ("sometimes", "no such file"),
])
def test_a_bad_availability_is_refused_by_its_key(text, names):
    with pytest.raises(ConfigError, match=r"availability: .*") as refused:
        RunConfig.of(availability=text)
    assert names in str(refused.value)


def test_a_trace_names_devices_by_index_or_id(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("device,offline,online\ndev001,5,9\n1,0,2\n3,1.5,4\n")
    assert parse_availability(str(trace), 4) == TraceAvailability({1: ((0.0, 2.0), (5.0, 9.0)), 3: ((1.5, 4.0),)})
    assert list(offline_spells(parse_availability(str(trace), 4), 0, 1)) == [(0.0, 2.0), (5.0, 9.0)]
    assert list(offline_spells(parse_availability(str(trace), 4), 0, 0)) == []


@pytest.mark.parametrize("rows, names", [
    ("device,start,end\n1,0,2\n", "header device,offline,online"),
    ("device,offline,online\ndev9,0,2\n", "line 2: device 'dev9' is not one of the run's 4 devices"),
    ("device,offline,online\n1,0,2\n1,x,3\n", "line 3: offline and online must be seconds"),
    ("device,offline,online\n1,3,2\n", "line 2: needs 0 <= offline < online"),
    ("device,offline,online\n1,0,5\n1,4,6\n", "offline spells of dev001 overlap at 4.0 s"),
])
def test_a_bad_trace_is_refused_with_its_line(tmp_path, rows, names):
    trace = tmp_path / "trace.csv"
    trace.write_text(rows)
    with pytest.raises(ConfigError, match="availability") as refused:
        RunConfig.of(availability=str(trace), clients=4)
    assert names in str(refused.value)


def test_random_spells_repeat_per_seed_and_device_and_keep_the_share_online():
    availability = RandomAvailability(0.3, 10.0)
    first = list(itertools.islice(offline_spells(availability, 7, 2), 50))
    assert first == list(itertools.islice(offline_spells(availability, 7, 2), 50))
    assert first != list(itertools.islice(offline_spells(availability, 7, 3), 50))
    assert all(start < end for start, end in first)
    assert all(end < start for (_, end), (start, _) in zip(first, first[1:], strict=False))
    spells = list(itertools.islice(offline_spells(availability, 0, 0), 5000))
    horizon = spells[-1][1]
    offline = sum(end - start for start, end in spells)
    assert 1 - offline / horizon == pytest.approx(0.3, abs=0.02)
    assert horizon / len(spells) == pytest.approx(10.0, rel=0.05)
    assert list(offline_spells(RandomAvailability(1.0, 10.0), 0, 0)) == []


def test_speed_factors_spread_log_uniformly_between_one_and_the_spread():
    factors = [speed_factor(10.0, 0, index) for index in range(2000)]
    assert factors == [speed_factor(10.0, 0, index) for index in range(2000)]
    assert all(1.0 <= f <= 10.0 for f in factors)
    below = sum(f < 10 ** 0.5 for f in factors) / len(factors)
    assert below == pytest.approx(0.5, abs=0.04)  # log-uniform: the geometric midpoint halves them
    assert speed_factor(1.0, 0, 3) == 1.0


def test_a_slowed_lock_waits_outside_the_lock_for_the_extra_time():
    # Prepare: a clock the test moves, and a record of the waits with the lock's state
    now = [100.0]
    lock = threading.Lock()
    waits: list[tuple[float, bool]] = []
    slowed = SlowedLock(lock, 4.0, clock=lambda: now[0], wait=lambda s: waits.append((s, lock.locked())))

    # Execute: hold it for 2 s
    with slowed:
        assert lock.locked()
        now[0] += 2.0

    # Assert: three times as long again, with the worker's lock free
    assert waits == [(6.0, False)]


@dataclass
class FakeDevice:
    client_id: str
    finished: bool = False


@dataclass
class FakeConnection:
    calls: list[str] = field(default_factory=list)
    dropped: threading.Event = field(default_factory=threading.Event)
    back: threading.Event = field(default_factory=threading.Event)

    def drop_connection(self) -> None:
        self.calls.append("drop")
        self.dropped.set()

    def reconnect(self) -> None:
        self.calls.append("reconnect")
        self.back.set()


@pytest.mark.parametrize("back_at, waited", [(0.01, "back"), (1e9, "dropped")],
                         ids=["back_on_its_schedule", "back_once_the_run_finished"])
def test_the_driver_takes_a_device_offline_and_back(back_at, waited):
    # Prepare: dev000 offline at once, until `back_at` s; dev001 always online
    away, staying = FakeDevice("dev000"), FakeDevice("dev001")
    connection = FakeConnection()
    driver = AvailabilityDriver([(away, connection, iter([(0.0, back_at)])), (staying, FakeConnection(), iter(()))],
                                threading.Event(), poll=0.01)

    # Execute: the run finishes once dev000 is back, or while it is away
    driver.start()
    assert getattr(connection, waited).wait(WAIT)
    staying.finished = True
    driver.join(WAIT)

    # Assert: it came back either way, so that it sees the run's end
    assert not driver.is_alive()
    assert connection.calls == ["drop", "reconnect"] and driver.transitions == 2
