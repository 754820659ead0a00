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

Two hooks make the queue fair under a flood (`Channel` sets both): `screen(item)` runs on the
network thread before a message is queued or counted against the byte bound and returns the
item to queue (possibly replaced) or None to drop it, so junk costs no flow-control wait and no
place in line; `fair_by(item)` names a message's sender, and `get` serves the senders with
messages waiting in turn (round robin), so one sender's backlog cannot delay another's message
by more than one message per sender.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
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
        self.screen: Callable[[Any], Any] | None = None
        self.fair_by: Callable[[Any], Hashable] = lambda item: None

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        """Queue `item` unless `screen` drops it (put_message and put_nowait come here too)."""
        if self.screen is not None:
            item = self.screen(item)
            if item is None:
                return
        super().put(item, block, timeout)

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

    # the queue's storage (queue.Queue calls these under its lock): one FIFO per sender, in turn
    def _init(self, maxsize: int) -> None:
        self._senders: OrderedDict[Hashable, deque] = OrderedDict()
        self._count = 0

    def _qsize(self) -> int:
        return self._count

    def _put(self, item: Any) -> None:
        with self._room:
            self.held_bytes += len(item.payload)
        self._senders.setdefault(self.fair_by(item), deque()).append(item)
        self._count += 1

    def _get(self) -> Any:
        sender, waiting = next(iter(self._senders.items()))
        item = waiting.popleft()
        if waiting:
            self._senders.move_to_end(sender)  # the next message of this sender waits its turn
        else:
            del self._senders[sender]
        self._count -= 1
        return item

    def _has_room(self) -> bool:
        return self._closed or self.held_bytes <= self.max_bytes
