"""The zero-setup default broker: amqtt (pure Python, MQTT 3.1.1) in a child process.

Good for simulations and trying things out on one machine. Production fleets use Mosquitto or
any MQTT 3.1.1/5 broker (see docs/DEPLOYING.md); everything else here works with either.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
from multiprocessing.process import BaseProcess
import socket
import time

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_for_port(host: str, port: int, timeout: float) -> bool:
    """True once a TCP connection to host:port succeeds, False after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


class SnapshotDict(dict):
    """A dict whose iteration walks a snapshot of its entries.

    amqtt (0.12.1) iterates its topic-filter -> subscribers dict across `await`s: when a client
    connects (sending it retained messages) and for every broadcast. A subscription that another
    client makes meanwhile raised "dictionary changed size during iteration", which dropped the
    connecting client (seen as "lost the broker connection: Unspecified error" right at
    registration, then a reconnect) or the broadcast. Iterating a snapshot removes the race; a
    subscription made during a broadcast misses only that message, as it would a moment earlier.
    """

    def __iter__(self):
        return iter(list(super().keys()))

    def items(self):
        return list(super().items())


def make_broker(config: dict):
    """An amqtt Broker for `config` with its subscription table made safe to change while it is
    iterated (see SnapshotDict). Must be called inside the event loop that will run it."""
    from amqtt.broker import Broker

    broker = Broker(config)
    if isinstance(getattr(broker, "_subscriptions", None), dict):
        broker._subscriptions = SnapshotDict(broker._subscriptions)
    return broker


def _serve(host: str, port: int, ready=None, log_level: int = logging.WARNING) -> None:
    """Run amqtt until the process is stopped. `ready`, the sending end of a Pipe, receives None
    once it listens, or why it could not start (the port taken, say), and the process ends."""
    import asyncio
    import signal

    if ready is not None:  # embedded: Ctrl-C is the owner's, which stops this process after its clients
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level)
    if log_level > logging.DEBUG:
        # amqtt logs every abrupt disconnect, and tracebacks of its own races on teardown, loudly
        for name in ("amqtt", "asyncio", "transitions"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    config = {
        "listeners": {"default": {"type": "tcp", "bind": f"{host}:{port}", "max_connections": 0}},
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
    }

    async def main() -> None:
        broker = make_broker(config)
        try:
            await broker.start()
        except Exception as exc:  # amqtt's BrokerError wraps the bind's OSError
            if ready is None:
                raise
            ready.send(str(exc))
            return
        if ready is not None:
            ready.send(None)
        await asyncio.Event().wait()

    asyncio.run(main())


class EmbeddedBroker:
    """Context manager: an amqtt broker on a free loopback port; `url` says where.

    A free port is free when it is picked, not always when the broker binds it: on a busy machine
    an outgoing connection can take it as its local port in between. A broker on a port it picked
    itself then tries another (START_ATTEMPTS in all); one on a port it was given fails at once.
    """

    START_ATTEMPTS = 3

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, start_timeout: float = 30.0):
        self.host = host
        self.port = port or free_port(host)
        self.port_given = port is not None
        self.start_timeout = start_timeout
        self._process: BaseProcess | None = None

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def start(self) -> EmbeddedBroker:
        try:
            import amqtt  # noqa: F401
        except ImportError:
            raise RuntimeError("the embedded broker needs amqtt: pip install 'edgepfl[broker]', "
                               "or pass --broker mqtt://host:port for an existing broker") from None
        error = self._start_process()
        for _ in range(0 if self.port_given else self.START_ATTEMPTS - 1):
            if error is None:
                break
            log.info("embedded amqtt broker: could not start on port %d (%s); trying another port", self.port, error)
            self.port = free_port(self.host)
            error = self._start_process()
        if error is not None:
            raise RuntimeError(f"the embedded amqtt broker did not start on {self.url}: {error}")
        log.info("embedded amqtt broker on %s", self.url)
        return self

    def _start_process(self) -> str | None:
        """Start the broker process on self.port; None once it listens, else why not (it is then stopped)."""
        context = multiprocessing.get_context("spawn")
        receiver, sender = context.Pipe(duplex=False)
        process = self._process = context.Process(target=_serve, args=(self.host, self.port, sender,
                                                                       logging.getLogger().getEffectiveLevel()),
                                                  daemon=True, name="edgepfl-broker")
        process.start()
        sender.close()  # the child holds its own end: its exit ends the pipe
        with receiver:
            if multiprocessing.connection.wait([receiver, process.sentinel], self.start_timeout):
                try:
                    error = receiver.recv() if receiver.poll() else f"it exited (code {process.exitcode})"
                except EOFError:
                    error = "it exited before it listened"
            else:
                error = f"it did not listen within {self.start_timeout:g} s"
        if error is not None:
            self.stop()
        return error

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.join(timeout=10)
            self._process = None

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
