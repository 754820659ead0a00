"""Unit tests for edge_sdk.flow.IncomingQueue: flow control in bytes between two threads."""

from __future__ import annotations

import queue
import threading
from typing import NamedTuple

import pytest

from edge_sdk.flow import IncomingQueue

TIMEOUT = 5.0
STILL = 0.2  # how long a put must stay blocked to count as blocked


class Message(NamedTuple):
    topic: str
    payload: bytes


def put_in_thread(incoming: IncomingQueue, message: Message) -> threading.Event:
    """Hand `message` over from another thread, as paho's network thread does; the event is
    set once put_message returns."""
    done = threading.Event()

    def network() -> None:
        incoming.put_message(message)
        done.set()

    threading.Thread(target=network, daemon=True).start()
    return done


def test_messages_under_the_budget_are_handed_over_without_waiting():
    # Prepare
    incoming = IncomingQueue(max_bytes=100)

    # Execute: the network thread's own calls; they would block the test if they waited
    for index in range(5):
        incoming.put_message(Message(f"t{index}", b"x" * 20))

    # Assert
    assert incoming.held_bytes == 100 and incoming.qsize() == 5
    assert [incoming.get_nowait().topic for _ in range(5)] == ["t0", "t1", "t2", "t3", "t4"]


def test_a_large_message_holds_the_network_thread_until_the_consumer_releases_it():
    # Prepare
    incoming = IncomingQueue(max_bytes=100)

    # Execute / Assert: handed over, the network thread waits while the message is held
    done = put_in_thread(incoming, Message("big", b"x" * 1000))
    assert not done.wait(STILL)
    assert incoming.get(timeout=TIMEOUT).topic == "big"
    assert not done.wait(STILL), "being handled still counts"
    incoming.release()
    assert done.wait(TIMEOUT)
    assert incoming.held_bytes == 0 and incoming.overruns == 0


def test_the_next_get_releases_the_message_handed_out_before():
    # Prepare: the consumer holds a large message; the network thread hands over another
    incoming = IncomingQueue(max_bytes=100)
    first = put_in_thread(incoming, Message("first", b"x" * 1000))
    incoming.get(timeout=TIMEOUT)

    # Execute
    with pytest.raises(queue.Empty):
        incoming.get(timeout=0.01)

    # Assert: asking for the next message released the first
    assert first.wait(TIMEOUT) and incoming.held_bytes == 0


def test_a_wait_that_lasts_too_long_lets_the_message_in_and_counts_an_overrun():
    # Prepare: nobody consumes
    incoming = IncomingQueue(max_bytes=100, max_wait=0.05)

    # Execute
    incoming.put_message(Message("big", b"x" * 1000))

    # Assert
    assert incoming.overruns == 1 and incoming.qsize() == 1


def test_close_ends_every_wait():
    # Prepare
    incoming = IncomingQueue(max_bytes=100)
    done = put_in_thread(incoming, Message("big", b"x" * 1000))
    assert not done.wait(STILL)

    # Execute
    incoming.close()

    # Assert: this wait and later ones end at once
    assert done.wait(TIMEOUT)
    incoming.put_message(Message("later", b"x" * 1000))
    assert incoming.overruns == 0


def test_beyond_max_items_a_message_is_refused_and_not_counted():
    # Prepare
    incoming = IncomingQueue(max_items=2)
    incoming.put_message(Message("a", b"1"))
    incoming.put_message(Message("b", b"2"))

    # Execute / Assert
    with pytest.raises(queue.Full):
        incoming.put_message(Message("c", b"3"))
    assert incoming.held_bytes == 2


def test_plain_puts_are_counted_too():
    # Prepare: the loopback transport puts without flow control
    incoming = IncomingQueue(max_items=0)

    # Execute
    incoming.put(Message("a", b"12345"))
    incoming.get_nowait()
    incoming.release()

    # Assert
    assert incoming.held_bytes == 0


@pytest.mark.parametrize("kwargs", [{"max_bytes": -1}, {"max_wait": 0}])
def test_bad_bounds_are_refused(kwargs):
    with pytest.raises(ValueError):
        IncomingQueue(**kwargs)


def test_senders_are_served_in_turn_so_one_backlog_does_not_delay_another_sender():
    # Prepare: a flooder's 5 messages queued before one device message
    incoming = IncomingQueue()
    incoming.fair_by = lambda message: message.topic.split("/")[0]
    for index in range(5):
        incoming.put_message(Message(f"flooder/{index}", b"x"))
    incoming.put_message(Message("device/0", b"x"))
    incoming.put_message(Message("device/1", b"x"))

    # Execute
    order = [incoming.get_nowait().topic for _ in range(7)]

    # Assert: the device's first message comes second, not sixth; each sender keeps its own order
    assert order == ["flooder/0", "device/0", "flooder/1", "device/1", "flooder/2", "flooder/3", "flooder/4"]


def test_a_screened_out_message_is_neither_queued_nor_held():
    # Prepare
    incoming = IncomingQueue(max_bytes=100)
    incoming.screen = lambda message: None if message.topic == "junk" else message

    # Execute: a dropped message larger than the byte bound must not make the network thread wait
    incoming.put_message(Message("junk", b"x" * 1000))
    incoming.put_message(Message("real", b"x" * 10))

    # Assert
    assert incoming.qsize() == 1 and incoming.held_bytes == 10
    assert incoming.get_nowait().topic == "real"
