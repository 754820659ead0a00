"""The one lifecycle of a federation hosted here (coordinator/hosting/lifecycle.py): the broker first,
then the hosted parts in order; on the way out, however it is left, the parts stopped in reverse
and the embedded broker last, each step taken even if one before it fails."""

from __future__ import annotations

import functools
import signal

import pytest

from coordinator.brokers.embedded import wait_for_port
from coordinator.config.run_config import RunConfig
from coordinator.hosting.lifecycle import LocalFederation, sigint_blocked

GIVEN_BROKER = "mqtt://127.0.0.1:9"  # named, so no embedded broker starts; nothing here connects to it


class Part:
    """A hosted part that records its stop (in `stopped`) and, when told, fails it."""

    def __init__(self, name: str, stopped: list[str], *, fails: bool = False):
        self.name, self.stopped, self.fails = name, stopped, fails
        self.blocked_while_started = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set())

    def join(self, timeout: float | None = None) -> None:
        pass

    def stop(self) -> None:
        self.stopped.append(self.name)
        if self.fails:
            raise RuntimeError(f"{self.name} would not stop")


def test_ctrl_c_stops_the_hosted_parts_in_reverse_order_and_sets_done() -> None:
    # Prepare
    stopped: list[str] = []
    config = RunConfig.of(broker=GIVEN_BROKER, federation="lifecycle")

    # Execute
    with pytest.raises(KeyboardInterrupt):
        with LocalFederation(config, "test") as local:
            parts = [local.host(functools.partial(Part, name, stopped)) for name in ("aggregators", "workers")]
            raise KeyboardInterrupt

    # Assert: started with Ctrl-C held back (children inherit it), stopped last first
    assert stopped == ["workers", "aggregators"] and local.done.is_set()
    assert all(part.blocked_while_started for part in parts)
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
    assert (local.url, local.config.broker.federation) == (GIVEN_BROKER, "lifecycle")


def test_a_part_that_fails_to_stop_does_not_keep_the_others_running() -> None:
    # Prepare
    stopped: list[str] = []

    # Execute
    with pytest.raises(RuntimeError, match="workers would not stop"):
        with LocalFederation(RunConfig.of(broker=GIVEN_BROKER), "test") as local:
            local.host(lambda: Part("aggregators", stopped))
            local.host(lambda: Part("workers", stopped, fails=True))
            local.host(lambda: Part("devices", stopped))

    # Assert
    assert stopped == ["devices", "workers", "aggregators"]
    assert local.config.broker.federation.startswith("test-")  # a federation of its own on a shared broker


def test_the_embedded_broker_serves_the_run_and_is_stopped_after_it() -> None:
    # Prepare
    stopped: list[str] = []

    # Execute
    with LocalFederation(RunConfig.of(), "test") as local:
        host, port = local.url.removeprefix("mqtt://").split(":")
        listening = wait_for_port(host, int(port), 30)
        local.host(lambda: Part("devices", stopped))

    # Assert
    assert listening and local.config.broker.mqtt_protocol == "3.1.1"
    assert stopped == ["devices"] and not wait_for_port(host, int(port), 0.5)


@pytest.fixture
def python_ctrl_c():
    """Python's own SIGINT handler (KeyboardInterrupt) during the test, whatever another test of
    this process left; yields the handler found."""
    found = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield found
    signal.signal(signal.SIGINT, found)


def test_a_ctrl_c_held_back_is_delivered_when_the_block_ends(python_ctrl_c) -> None:
    # Execute
    held = delivered = False
    try:
        with sigint_blocked():
            signal.raise_signal(signal.SIGINT)
            held = True
    except KeyboardInterrupt:
        delivered = True

    # Assert
    assert held and delivered, (f"handler found: {python_ctrl_c!r}; blocked now: "
                                f"{signal.pthread_sigmask(signal.SIG_BLOCK, set())}")
