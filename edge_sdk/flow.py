"""Flow control of received messages: a queue from the MQTT network thread to one consumer.

Bounded in messages (beyond `max_items` a message is refused and the transport counts it as
dropped) and, with `max_bytes`, in bytes: after handing a message over, the network thread
waits while the consumer holds more than `max_bytes`. A message is held from its arrival until
the consumer `release`s it, which its next `get` does at the latest. While the network thread
waits it reads nothing from its socket, so TCP flow control leaves the backlog with the broker
instead of this process. The broker must then be allowed to queue it (Mosquitto:
`max_queued_messages`, `max_queued_bytes`; `edgepfl broker-config` sets them).

A wait lasts at most `max_wait` seconds; then one more message is let in (counted in
`overruns`), so a consumer that stops asking cannot starve the MQTT keepalive. `close()` ends
every wait for good.
"""

from __future__ import annotations

import queue
import threading
from typing import Any


class IncomingQueue(queue.Queue):
    """Received messages (anything with a `payload`) for one consumer, bounded in count and
    optionally in bytes."""

    def __init__(self, max_items: int = 10_000, max_bytes: int = 0, max_wait: float = 15.0):
        super().__init__(maxsize=max_items)
        if max_bytes < 0 or max_wait <= 0:
            raise ValueError("max_bytes must be zero (no bound) or positive, and max_wait positive")
        self.max_bytes = max_bytes
        self.max_wait = max_wait
        self.held_bytes = 0
        self.overruns = 0
        self._handed_out = 0
        self._closed = False
        self._room = threading.Condition()

    def put_message(self, item: Any) -> None:
        """Network thread: enqueue (queue.Full when `max_items` wait), then wait for room."""
        self.put_nowait(item)
        if self.max_bytes:
            with self._room:
                if not self._room.wait_for(self._has_room, self.max_wait):
                    self.overruns += 1

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """Consumer: release the message handed out last, then take the next one."""
        self.release()
        item = super().get(block, timeout)
        self._handed_out = len(item.payload)
        return item

    def release(self) -> None:
        """Consumer: the message handed out last is handled; its bytes no longer count."""
        size, self._handed_out = self._handed_out, 0
        if size:
            with self._room:
                self.held_bytes -= size
                self._room.notify_all()

    def close(self) -> None:
        """Stop every wait, now and later (the connection is closing)."""
        with self._room:
            self._closed = True
            self._room.notify_all()

    def _put(self, item: Any) -> None:  # under the queue's lock, for put and put_nowait alike
        with self._room:
            self.held_bytes += len(item.payload)
        super()._put(item)

    def _has_room(self) -> bool:
        return self._closed or self.held_bytes <= self.max_bytes
