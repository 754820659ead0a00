"""The run's books: round records, traffic and rejections over every incarnation, and events.

A coordinator restarted from a checkpoint starts new byte counters; the ledger adds what the
earlier incarnations counted, so report.json covers the whole run. Events (registrations,
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

    def to_history(self) -> dict[str, Any]:
        traffic = self.traffic()
        return {
            "rounds": self.rounds,
            "final": self.final,
            "events": self.events,
            "sent": traffic["sent"],
            "received": traffic["received"],
            "rejections": self.rejections(),
            "duplicates": self.duplicates(),
        }
