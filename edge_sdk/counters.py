"""Byte and event counters: every byte a side publishes or receives, by direction and kind."""

from __future__ import annotations

import threading
from collections import Counter


class ByteCounter:
    """Thread-safe tallies of MQTT payload+topic bytes, keyed by (direction, message kind).

    The kind is the topic's last segment, so chunk frames count toward the kind they carry.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: Counter[tuple[str, str]] = Counter()
        self._messages: Counter[tuple[str, str]] = Counter()

    def record(self, direction: str, topic: str, payload_len: int) -> None:
        kind = topic.rsplit("/", 1)[-1]
        with self._lock:
            self._bytes[(direction, kind)] += payload_len + len(topic)
            self._messages[(direction, kind)] += 1

    def total(self, direction: str) -> int:
        with self._lock:
            return sum(n for (d, _), n in self._bytes.items() if d == direction)

    def by_kind(self) -> dict[str, dict[str, int]]:
        """{"sent": {kind: bytes}, "received": {kind: bytes}}."""
        out: dict[str, dict[str, int]] = {"sent": {}, "received": {}}
        with self._lock:
            for (direction, kind), n in sorted(self._bytes.items()):
                out.setdefault(direction, {})[kind] = n
        return out

    def snapshot(self) -> tuple[int, int]:
        """(bytes sent, bytes received) so far."""
        return self.total("sent"), self.total("received")
