"""The run's books: round records, traffic and rejections over every incarnation, and events.

A coordinator restarted from a checkpoint starts new byte counters; the ledger adds what the
earlier incarnations counted (bytes published and delivered, rejections, wall time), so
report.json covers the whole run. Delivered bytes are what the broker hands on: the coordinator
counts each of its publications once per recipient (`count_delivered`). Events (registrations,
devices going offline, broker reconnections) let a report say what happened during a run.
"""

from __future__ import annotations

import time
from typing import Any

from edge_sdk.channel import Channel

MAX_EVENTS = 10_000


class Ledger:
    """Everything report.json needs that is not the algorithm's state; checkpointed as a dict."""

    def __init__(self, channel: Channel, history: dict[str, Any] | None = None):
        history = history or {}
        self.channel = channel
        self.rounds: list[dict[str, Any]] = list(history.get("rounds", []))
        self.final: dict[str, Any] | None = history.get("final")
        self.events: list[dict[str, Any]] = list(history.get("events", []))
        self._base_traffic = {d: dict(history.get(d, {})) for d in ("sent", "received")}
        self._base_rejections = dict(history.get("rejections", {}))
        self._base_duplicates = int(history.get("duplicates", 0))
        self._delivered = {kind: int(n) for kind, n in history.get("delivered", {}).items()}
        self.base_wall_seconds = float(history.get("wall_seconds", 0.0))
        """Wall time of the earlier incarnations."""

    def event(self, kind: str, **fields: Any) -> None:
        if len(self.events) < MAX_EVENTS:
            self.events.append({"event": kind, "time": time.time(), **fields})

    def traffic(self) -> dict[str, dict[str, int]]:
        """Bytes by direction ('sent', 'received') and message kind, over the whole run."""
        now = self.channel.counter.by_kind()
        merged: dict[str, dict[str, int]] = {}
        for direction in ("sent", "received"):
            totals = dict(self._base_traffic[direction])
            for kind, n in now.get(direction, {}).items():
                totals[kind] = totals.get(kind, 0) + n
            merged[direction] = totals
        return merged

    def count_delivered(self, kind: str, n: int) -> None:
        """`n` bytes of `kind` delivered by the broker to devices."""
        self._delivered[kind] = self._delivered.get(kind, 0) + n

    def delivered(self) -> dict[str, int]:
        """Bytes delivered to devices by message kind, over the whole run."""
        return dict(sorted(self._delivered.items()))

    def delivered_total(self) -> int:
        return sum(self._delivered.values())

    def rejections(self) -> dict[str, int]:
        totals = dict(self._base_rejections)
        for reason, n in self.channel.rejections.items():
            totals[reason] = totals.get(reason, 0) + n
        return totals

    def duplicates(self) -> int:
        return self._base_duplicates + self.channel.duplicates

    def event_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for entry in self.events:
            counts[entry["event"]] = counts.get(entry["event"], 0) + 1
        return counts

    def to_history(self, wall_seconds: float) -> dict[str, Any]:
        """What a checkpoint keeps; `wall_seconds` is the run's wall time so far."""
        traffic = self.traffic()
        return {
            "delivered": self.delivered(),
            "wall_seconds": wall_seconds,
            "rounds": self.rounds,
            "final": self.final,
            "events": self.events,
            "sent": traffic["sent"],
            "received": traffic["received"],
            "rejections": self.rejections(),
            "duplicates": self.duplicates(),
        }
