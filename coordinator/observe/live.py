"""What the live view in the browser shows of a run: `LiveState`, kept from the coordinator's events.

`LiveState` subscribes to a coordinator's events like the Prometheus exporter and keeps the run
(algorithm, dataset, model, round r of R, seconds per round, time left), every device (kind,
online or offline, last seen, the rounds it was selected for, replied, was late, missing or
refused in, the rejections of its answers by reason, its last accuracy), one point per round
(accuracy mean and spread, MB up and down, participants, epsilon under DP) and the latest device
events (bounded). `to_json()` is the whole of it, which the page polls at `/state.json`.
`from_folder` builds the same state from a run folder's report.json and metrics.jsonl (for
`edgepfl view`); what only the events tell (who replied in which round) is then unknown (None).
Under DP (`private`) the state publishes nothing that depends on a device's data or on who was
sampled: no device's counts, rejections or accuracy, no per-round counts of devices or uploads
and no spread of the accuracies, only the released mean, the epsilon, and who is online.
The HTTP server reads the state from its own threads while the coordinator's thread feeds it,
so both go through one lock.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..events import (DeviceOffline, DeviceOnline, DevicesRegistered, EventBus, RegistrationOpened, ReleaseServed,
                      RoundEnded, RoundStarted, RunStarted, UpdateAccepted)
from ..run.folder import RunFolder
from ..run.report_files import read_report

EVENT_HISTORY = 200
"""Device events kept for the page (the oldest go first)."""
AGGREGATOR = "aggregator"
"""The kind of a shard aggregator: it holds no data and is not listed among the devices."""


@dataclass
class DeviceView:
    """One device as the page lists it; a count is None where the source does not tell it."""

    id: str
    kind: str
    online: bool | None = None
    last_seen: float | None = None
    selected: int | None = 0
    replied: int | None = 0
    late: int | None = 0
    missing: int | None = 0
    refused: int | None = 0
    accuracy: float | None = None
    accuracy_round: int | None = None
    rejections: dict[str, int] = field(default_factory=dict)
    """Its rejected answers by reason (a `Reason` value)."""
    release: int | None = None
    """The numbered release it holds (a weak device): fetched in a run, deployed in the inventory."""
    kept: str | None = None
    """Why it kept an older release than the one it evaluated last (the inventory)."""


DEVICE_COUNTS = ("selected", "replied", "late", "missing", "refused")
"""A device's participation counts: under DP they would publish the sampling and its answers."""
ROUND_COUNTS = ("selected", "participants", "late", "missing", "refused", "mb_up", "accuracy_std", "accuracy_min")
"""A round's figures withheld under DP: counts of devices and uploads, and the accuracies' spread
(only the released mean is inside the guarantee)."""
DEVICE_EVENTS = frozenset({"refused", "late", "missing"})
"""Events of a device's answers in a round, not listed under DP."""


def round_point(record: dict[str, Any]) -> dict[str, Any]:
    """The figures the page charts for one round, from its metrics.jsonl record."""
    accuracy = record.get("personalized_accuracy") or {}
    return {"round": record["round"], "outcome": record.get("outcome"),
            "accuracy": accuracy.get("mean"), "accuracy_std": accuracy.get("std"), "accuracy_min": accuracy.get("min"),
            "mb_up": record.get("bytes_up", 0) / 1e6, "mb_down": record.get("bytes_down", 0) / 1e6,
            "selected": record.get("selected"), "participants": record.get("participants"),
            "late": record.get("late", 0), "missing": record.get("missing", 0), "refused": record.get("refused", 0),
            "epsilon": (record.get("privacy") or {}).get("epsilon"), "seconds": record.get("seconds")}


class LiveState:
    """The run, its devices, its rounds and its latest events; fed events (`attach`, `on_event`)."""

    EVENTS = (RunStarted, RegistrationOpened, DevicesRegistered, RoundStarted, UpdateAccepted, RoundEnded,
              DeviceOnline, DeviceOffline, ReleaseServed)

    def __init__(self, run: dict[str, Any], *, folder: RunFolder | None = None, clock: Callable[[], float] = time.time,
                 history: int = EVENT_HISTORY, private: bool = False) -> None:
        """`run`: what the events do not say of the run (algorithm, dataset, model, federation);
        `folder`: the run's folder, whose metrics.jsonl gives the rounds a resumed run played before;
        `private`: the run is under DP (what is withheld then: the module's docstring)."""
        self.folder = folder
        self.private = private
        self.clock = clock
        self.run: dict[str, Any] = {"run_id": None, "rounds": None, "completed": 0, "current": None,
                                    "phase": "starting", "expected": None, "finished": False, **run}
        self.devices: dict[str, DeviceView] = {}
        self.rounds: list[dict[str, Any]] = []
        self.events: deque[dict[str, Any]] = deque(maxlen=history)
        self.rejections: dict[str, int] = {}
        self.source = "live"
        self._lock = threading.Lock()

    def attach(self, bus: EventBus) -> None:
        """Subscribe to the events the state follows."""
        bus.subscribe(self.on_event, *self.EVENTS)

    def on_event(self, event: Any) -> None:
        """Update what an event changes (others are ignored)."""
        with self._lock:
            handle = self._handlers.get(type(event))
            if handle is not None:
                handle(self, event)

    def _run_started(self, event: RunStarted) -> None:
        self.run.update(run_id=event.run_id, rounds=event.rounds, completed=event.after_round,
                        finished=event.after_round >= event.rounds)
        if event.after_round and self.folder is not None:
            self.rounds = [round_point(r) for r in _round_records(self.folder) if r["round"] <= event.after_round]

    def _registration_opened(self, event: RegistrationOpened) -> None:
        self.run.update(phase="registering", expected=event.expected)

    def _devices_registered(self, event: DevicesRegistered) -> None:
        self.run["phase"] = "registered"

    def _round_started(self, event: RoundStarted) -> None:
        self.run.update(current=event.round, phase="training")
        for device in event.selected:
            view = self._device(device)
            view.selected = (view.selected or 0) + 1

    def _update_accepted(self, event: UpdateAccepted) -> None:
        self._device(event.device).last_seen = self.clock()

    def _round_ended(self, event: RoundEnded) -> None:
        self.rounds.append(round_point(event.record))
        last = self.run["rounds"] is not None and event.round >= self.run["rounds"]
        self.run.update(completed=event.round, current=None, phase="final evaluation" if last else "between rounds")
        for reason, count in event.channel.rejections.items():
            self.rejections[reason] = self.rejections.get(reason, 0) + count
        devices, now = event.devices, self.clock()
        for device in devices.replied:
            self._count(device, "replied")
        for device, reason in devices.refused.items():
            view = self._count(device, "refused")
            view.rejections[reason] = view.rejections.get(reason, 0) + 1
            self._note(device, "refused", round=event.round, reason=reason)
        for device in devices.late:
            self._count(device, "late")
            self._note(device, "late", round=event.round)
        for device in devices.missing:
            self._count(device, "missing")
            self._note(device, "missing", round=event.round)
        for device, accuracy in devices.accuracy.items():
            view = self._device(device)
            view.accuracy, view.accuracy_round, view.last_seen = accuracy, event.round, now

    def _device_online(self, event: DeviceOnline) -> None:
        if event.kind == AGGREGATOR:
            return
        known = self.devices.get(event.device)
        view = self._device(event.device, event.kind)
        view.kind = event.kind
        was_online = None if known is None else known.online
        self._note(event.device, {None: "online", True: "registered again", False: "reconnected"}[was_online])
        view.online, view.last_seen = True, self.clock()

    def _device_offline(self, event: DeviceOffline) -> None:
        if event.device in self.devices:
            self.devices[event.device].online = False
            self._note(event.device, "offline")

    def _release_served(self, event: ReleaseServed) -> None:
        view = self._device(event.device)
        view.last_seen, view.release = self.clock(), event.version
        self._note(event.device, "released", bytes=event.bytes)

    _handlers: dict[type, Callable[[LiveState, Any], None]] = {
        RunStarted: _run_started, RegistrationOpened: _registration_opened, DevicesRegistered: _devices_registered,
        RoundStarted: _round_started, UpdateAccepted: _update_accepted, RoundEnded: _round_ended,
        DeviceOnline: _device_online, DeviceOffline: _device_offline, ReleaseServed: _release_served}

    def _device(self, device: str, kind: str = "trainer") -> DeviceView:
        """The device's view, made (of `kind`) on first sight."""
        return self.devices.setdefault(device, DeviceView(device, kind))

    def _count(self, device: str, what: str) -> DeviceView:
        view = self._device(device)
        setattr(view, what, (getattr(view, what) or 0) + 1)
        return view

    def _note(self, device: str | None, what: str, *, at: float | None = None, **details: Any) -> None:
        if self.private and what in DEVICE_EVENTS:
            return
        self.events.append({"time": self.clock() if at is None else at, "device": device, "event": what, **details})

    def to_json(self) -> dict[str, Any]:
        """The whole state, as the page reads it."""
        with self._lock:
            seconds = [r["seconds"] for r in self.rounds if r.get("seconds") is not None]
            per_round = sum(seconds) / len(seconds) if seconds else None
            rounds, completed = self.run["rounds"], self.run["completed"]
            left = None if per_round is None or rounds is None else max(0, rounds - completed) * per_round
            devices = [asdict(view) for _, view in sorted(self.devices.items())]
            rounds, rejections = list(self.rounds), dict(sorted(self.rejections.items()))
            if self.private:
                devices = [{**d, **dict.fromkeys(DEVICE_COUNTS), "accuracy": None, "accuracy_round": None,
                            "rejections": {}, "kept": None} for d in devices]
                rounds, rejections = [{**r, **dict.fromkeys(ROUND_COUNTS)} for r in rounds], {}
            return {"source": self.source, "now": self.clock(),
                    "run": {**self.run, "seconds_per_round": per_round, "seconds_left": left,
                            "online": sum(1 for d in devices if d["online"]), "devices": len(devices),
                            "private": self.private},
                    "devices": devices, "rounds": rounds, "events": list(self.events), "rejections": rejections}

    def to_bytes(self) -> bytes:
        """`to_json()` as JSON text; a figure that is not finite (NaN) is null."""
        return json.dumps(_finite(self.to_json()), allow_nan=False).encode()

    @classmethod
    def from_folder(cls, folder: RunFolder, *, history: int = EVENT_HISTORY) -> LiveState:
        """The state of the run in `folder`: its rounds from metrics.jsonl, the rest from
        report.json once the run wrote it (a run still going shows its rounds only). Per-round
        participation by device is not in these files: those counts are None."""
        report = read_report(folder) or {}
        records = _round_records(folder)
        private = report.get("privacy") is not None or any(r.get("privacy") is not None for r in records)
        state = cls({key: report.get(key) for key in ("algorithm", "dataset", "model")}, history=history,
                    private=private)
        state.source = "folder"
        state.rounds = [round_point(r) for r in records]
        completed = report.get("rounds_completed", len(state.rounds))
        state.run.update(run_id=report.get("run_id"), completed=completed, finished=bool(report),
                         rounds=completed if report else None, phase="finished" if report else "running")
        state.rejections = dict(report.get("rejections") or {})
        kinds = {d: e.get("kind", "trainer") for d, e in ((report.get("data") or {}).get("per_device") or {}).items()}
        final = (report.get("final") or {}).get("per_client") or {}
        for device in sorted({*kinds, *final}):
            view = DeviceView(device, final.get(device, {}).get("kind") or kinds.get(device, "trainer"),
                              selected=None, replied=None, late=None, missing=None, refused=None)
            accuracy = final.get(device, {}).get("accuracy")
            if isinstance(accuracy, (int, float)):
                view.accuracy, view.accuracy_round = float(accuracy), completed
            state.devices[device] = view
        for entry in report.get("event_log") or []:
            state._logged(entry)
        state._inventory(folder)
        return state

    def _inventory(self, folder: RunFolder) -> None:
        """Which release each weak device runs (`edgepfl release serve` keeps it up to date): weak
        devices that came online after training are listed too."""
        from ..releases.inventory import Inventory
        from ..releases.store import ReleaseStore

        self.run["release"] = ReleaseStore(folder.path).read_state().current
        for device, entry in Inventory(folder.path).devices.items():
            view = self.devices.setdefault(device, DeviceView(device, "lite", selected=None, replied=None, late=None,
                                                              missing=None, refused=None))
            view.release, view.kept = entry.get("runs"), entry.get("kept")
            if isinstance(entry.get("accuracy"), (int, float)):
                view.accuracy = float(entry["accuracy"])
            if view.last_seen is None or entry["reported"] > view.last_seen:
                view.last_seen = entry["reported"]

    def _logged(self, entry: dict[str, Any]) -> None:
        """A report's event_log entry: device comings and goings, the release."""
        what, device = _LOGGED.get(entry.get("event", "")), entry.get("device")
        if what is None or (device is not None and device not in self.devices):
            return
        if device is not None:
            view = self.devices[device]
            view.online, view.last_seen = what != "offline", entry.get("time")
        self._note(device, what, at=entry.get("time"), round=entry.get("round"))


_LOGGED = {"registered": "online", "rejoined": "reconnected", "offline": "offline", "released": "released"}
"""report.json event_log entries the page lists, as the live events name them."""


def _round_records(folder: RunFolder) -> list[dict[str, Any]]:
    """The round lines of metrics.jsonl, one per round (a torn last line left out)."""
    records: dict[int, dict[str, Any]] = {}
    try:
        lines = folder.metrics.read_text().splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if entry.get("event") == "round":
            records.setdefault(int(entry["round"]), entry)
    return [records[r] for r in sorted(records)]


def _finite(value: Any) -> Any:
    """`value` with every float that is not finite (NaN, inf) replaced by None, which JSON can carry."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value
