"""The tests' Mosquitto starter: a taken port is noticed when Mosquitto exits, not by a timeout."""

import socket
import time

import pytest

from harness import brokers
from harness.brokers import Mosquitto


@pytest.fixture
def bound_port():
    """A loopback port another socket has bound but does not listen on, as an outgoing connection's is."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    yield sock.getsockname()[1]
    sock.close()


def test_a_given_port_that_is_taken_fails_at_once(bound_port, tmp_path) -> None:
    broker = Mosquitto(tmp_path / "mosquitto", port=bound_port)
    started = time.monotonic()

    with pytest.raises(RuntimeError, match=f"did not start on port {bound_port}"):
        broker.start()

    assert time.monotonic() - started < 10, "noticed by Mosquitto's exit, not by the 15 s wait"


def test_a_picked_port_taken_before_mosquitto_binds_it_is_replaced(bound_port, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(brokers, "free_port", lambda: bound_port)
    broker = Mosquitto(tmp_path / "mosquitto")
    monkeypatch.undo()

    broker.start()
    try:
        assert broker.port != bound_port
        assert brokers.wait_for_port("127.0.0.1", broker.port, 5.0)
    finally:
        broker.stop()
