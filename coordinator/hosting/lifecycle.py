"""The life of a federation hosted on this machine: broker, hosted parts, coordinator, and back.

`Federation` (coordinator/federation.py: devices as threads of this process) and `edgepfl
simulate` (coordinator/hosting/simulate.py: devices and shard aggregators in worker processes) run the
same sequence, written here once (`LocalFederation`):

1. the broker: the embedded amqtt one, started here, unless the run names one; the run gets a
   federation name of its own unless it names one (a broker may serve other federations);
2. the parts the run hosts besides the coordinator (shard aggregators, devices), in the order
   they are handed over (`host`): devices retry their HELLO until the coordinator announces the
   run, so they start first and load their data while the coordinator builds its model;
3. the coordinator, on a connection of its own, until its run ends (`run_coordinator`).

Then back in reverse: the coordinator's connection closed, `done` set, the hosted parts given
`JOIN_TIMEOUT` seconds each to leave on the run's `finished` STATUS; and on leaving the `with`
block, however it is left (the run's end, an error, Ctrl-C's KeyboardInterrupt, SIGTERM's
unwinding in the CLI), those still running are stopped and the embedded broker last, every step
taken even if one before it fails.

Child processes (the embedded broker, worker and aggregator processes) are started with SIGINT
blocked (`sigint_blocked`): each ignores Ctrl-C from its first instruction (it is the parent's
to stop them), so a Ctrl-C at the terminal, which reaches the whole process group, cannot kill
one half-started with a traceback.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker
from typing import Any, Protocol, TypeVar

from ..brokers.embedded import EmbeddedBroker
from ..config.run_config import RunConfig
from ..server import Coordinator


class Hosted(Protocol):
    """Devices or shard aggregators this machine runs for the federation, started on creation."""

    def join(self, timeout: float | None = None) -> None:
        """Wait (up to `timeout` seconds) for them to leave at the run's end."""

    def stop(self) -> None:
        """End those still running, now."""


H = TypeVar("H", bound=Hosted)


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """SIGINT held back in this thread meanwhile; a process started meanwhile inherits the mask and
    so starts deaf to Ctrl-C until it decides (the simulation's children ignore it, then unblock).
    A Ctrl-C that comes meanwhile is not lost: it is delivered when the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread's mask matters: Python handles signals there
        return
    # multiprocessing's resource tracker, started with the first child, unblocks SIGINT after its
    # own start: started first, it leaves the block alone
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def ignore_ctrl_c() -> None:
    """In a child process of the simulation: Ctrl-C is the parent's, which stops this process.
    Ignored first, then unblocked (`sigint_blocked`), so one that came meanwhile is dropped."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class LocalFederation:
    """A context manager hosting a run's broker and parts on this machine (see the module).

    Inside the `with` block, `config` is the run's configuration as the hosted parts and the
    coordinator use it (its own federation name, MQTT 3.1.1 for the embedded broker) and `url`
    the broker's address; `done` is set once the coordinator's run ended or failed, so watches
    over hosted processes stop reporting their exits as deaths."""

    JOIN_TIMEOUT = 30.0
    """Seconds each hosted part gets to leave on its own once the run finished."""

    def __init__(self, config: RunConfig, name_prefix: str):
        if config.broker.federation == "default":  # a broker may serve other federations
            config = config.replace(federation=f"{name_prefix}-{uuid.uuid4().hex[:8]}")
        self.config = config
        self.url: str = config.broker.broker or ""
        self.done = threading.Event()
        self._hosted: list[Hosted] = []
        self._cleanup = contextlib.ExitStack()

    def __enter__(self) -> LocalFederation:
        if self.config.broker.broker is None:
            broker = EmbeddedBroker()
            self._cleanup.callback(broker.stop)  # registered first: stopped last, even if it half started
            try:
                with sigint_blocked():
                    broker.start()
            except BaseException:
                self._cleanup.close()
                raise
            self.url = broker.url
            self.config = self.config.replace(mqtt_protocol="3.1.1")  # amqtt speaks MQTT 3.1.1 only
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self._cleanup.close()  # LIFO: the hosted parts, last started first; the broker last

    def host(self, start: Callable[[], H]) -> H:
        """Start a hosted part (`start()` returns it started) with SIGINT held back in this
        thread meanwhile; it is joined and stopped at the end in reverse order of hosting."""
        with sigint_blocked():
            hosted = start()
            self._hosted.append(hosted)
            self._cleanup.callback(hosted.stop)
        return hosted

    def run_coordinator(self, build: Callable[[Any], Coordinator]) -> dict[str, Any]:
        """Connect the coordinator, build it on its channel (`build(channel)`), run it to its end
        and give the hosted parts `JOIN_TIMEOUT` s each to leave; returns the run's report."""
        transport = self.config.coordinator_transport(self.url)
        transport.connect()
        try:
            report = build(self.config.coordinator_channel(transport)).run()
        finally:
            transport.close()
        self.done.set()  # the hosted parts now end on their own: not news for the watches
        for hosted in reversed(self._hosted):
            hosted.join(timeout=self.JOIN_TIMEOUT)
        return report
